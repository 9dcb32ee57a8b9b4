"""The generated reference pages match their sources, and the docs' links lead somewhere."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "generate_docs.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("generate_docs", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current() -> None:
    # The drift check itself: regenerate from crds/ and values.yaml as they are now and compare.
    result = subprocess.run([sys.executable, "-P", str(SCRIPT), "--check"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, f"docs are stale; run python -P scripts/generate_docs.py\n{result.stderr}"


def test_a_changed_crd_changes_the_page() -> None:
    # Guards the guard: an edited description, default or new field must show up in the page.
    gen = generator()
    crd = yaml.safe_load((ROOT / "crds" / "decodeservice.yaml").read_text(encoding="utf-8"))
    before = gen.crd_reference(crd)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["zzNewKnob"] = {"type": "integer", "default": 7, "minimum": 2,
                                       "description": "A knob only this test has."}
    after = gen.crd_reference(crd)
    assert after != before
    row = next(line for line in after.splitlines() if "`spec.zzNewKnob`" in line)
    assert "`7`" in row and ">= 2" in row and "A knob only this test has." in row


def _paths(schema: dict[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for name, child in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}"
        out.append(path)
        out += _paths(child, path)
        if isinstance(child.get("items"), dict):
            out += _paths(child["items"], f"{path}[]")
    return out


def test_every_crd_field_has_a_row() -> None:
    # An independent walk of the schema: each spec and status field is in the reference page.
    page = (ROOT / "docs" / "reference" / "decodeservice.md").read_text(encoding="utf-8")
    crd = yaml.safe_load((ROOT / "crds" / "decodeservice.yaml").read_text(encoding="utf-8"))
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    paths = _paths(root["properties"]["spec"], "spec") + _paths(root["properties"].get("status", {}), "status")
    assert len(paths) > 30
    missing = [p for p in paths if f"`{p}`" not in page]
    assert missing == []


def _undocumented(text: str) -> list[str]:
    """values.yaml keys with no `# --` comment on themselves or on every key below them."""
    documented = {key.path for key in generator()._value_keys(text)}
    values = yaml.safe_load(text)

    def walk(node: Any, prefix: str) -> list[str]:
        out: list[str] = []
        for name, child in node.items():
            path = f"{prefix}{name}"
            if path in documented:
                continue
            if isinstance(child, dict) and child:
                out += walk(child, path + ".")
            else:
                out.append(path)
        return out

    return walk(values, "")


def test_every_helm_value_is_documented() -> None:
    text = (ROOT / "charts" / "decodeservice-operator" / "values.yaml").read_text(encoding="utf-8")
    assert _undocumented(text) == []
    assert _undocumented(text + "\nnewKey: 1\n") == ["newKey"]


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_relative_links_resolve() -> None:
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"`[^`\n]*`", "", page.read_text(encoding="utf-8"))  # code spans hold no links
        for target, anchor in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and target.endswith(".md") and anchor[1:] not in _anchors(page.parent / target):
                broken.append(f"{page.relative_to(ROOT)} -> {target}{anchor}")
    assert broken == []


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_docs_name_only_results_that_exist() -> None:
    # benchmarks/results keeps the latest run of each study; a page naming a deleted file is stale, except
    # where it says how to print the old file from git history (`git show COMMIT:PATH`).
    known = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for line in page.read_text(encoding="utf-8").splitlines():
            if "git show" in line:
                continue
            for name in re.findall(r"[\w.-]+\.(?:json|png)", line):
                if re.match(r"^[a-z]", name) and "_" in name and name not in known and not name.startswith("report"):
                    missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert missing == []


def test_readme_states_the_charts_kubernetes_version() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "decodeservice-operator" / "Chart.yaml").read_text(encoding="utf-8"))
    raw = chart["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)\.\d+(-0)?", raw)
    assert match, f"kubeVersion {raw!r} is not a plain lower bound; reword the README's prerequisites"
    minor = f"{match[1]}.{match[2]}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"Kubernetes **{minor} or newer**" in readme and f'`kubeVersion: "{raw}"`' in readme
    assert f"kubernetes-validate --strict -k {minor} -" in readme
