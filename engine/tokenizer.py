"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the model's special tokens and chat template.

Two sources, both producing exactly what HF transformers produces for the same model:

* a GGUF file's `tokenizer.ggml.*` metadata (byte-level BPE only), rebuilt the way transformers'
  GGUF integration rebuilds it;
* a HF model directory's `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from decodeservice.engine.errors import UnsupportedModelError

# llama.cpp's token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2, Qwen2.5 and Qwen3: Llama 3's split, but digits one at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral-Nemo's tekken BPE: cased words split apart, digits one at a time.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with; None: GPT-2's own regex.
_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet every byte-level token is spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids for one model, and its chat template."""

    def __init__(
        self,
        *,
        backend: tokenizers.Tokenizer,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        chat_template: str | None,
        extra_special_tokens: Mapping[str, str | None] | None = None,
    ) -> None:
        # BOS/EOS insertion, when the model wants it, lives in the backend's post-processor, so that
        # encode() is exactly `tokenizer(text)["input_ids"]` in transformers.
        self.backend = backend
        self.bos_token = bos_token
        self.bos_token_id = self._require_id(bos_token) if bos_token is not None else None
        self.eos_tokens = tuple(eos_tokens)
        self.eos_token_ids = tuple(dict.fromkeys(self._require_id(t) for t in self.eos_tokens))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._template_vars: dict[str, str | None] = {
            "bos_token": bos_token,
            "eos_token": self.eos_tokens[0] if self.eos_tokens else None,
            **(extra_special_tokens or {}),
        }
        self._compiled: jinja2.Template | None = None

    def _require_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise UnsupportedModelError(f"special token {token!r} is not in the vocabulary")
        return token_id

    # -- ids ---------------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become single ids.

        `add_special_tokens=False` skips the model's BOS/EOS insertion: use it for a prompt rendered
        by apply_chat_template, whose template already writes them (as transformers does).
        """
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry itself (byte-level spelling, e.g. 'Ġthe'), not its decoded text."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return piece

    def token_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    # -- chat --------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render a conversation the way transformers' `apply_chat_template(tokenize=False)` does."""
        if self.chat_template is None:
            raise UnsupportedModelError("this model has no chat template")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._template_vars
        )

    # -- constructors ------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF's `tokenizer.*` fields (plain Python values, keyed by full name)."""
        model = metadata.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"GGUF tokenizer model {model!r} is not supported; byte-level BPE "
                                        "('gpt2') and sentencepiece BPE ('llama': Llama 2, Mistral 7B) are")
        if model == "llama":
            pieces = list(metadata["tokenizer.ggml.tokens"])
            return cls._with_specials(metadata, _sentencepiece_backend(metadata), pieces, alphabet=None)
        pre = str(metadata.get("tokenizer.ggml.pre", "default"))
        if pre not in _PRE_TOKENIZER_SPLITS:
            raise UnsupportedModelError(
                f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_TOKENIZER_SPLITS))}"
            )
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        merges: list[str] = list(metadata.get("tokenizer.ggml.merges", []))
        if not merges:
            raise UnsupportedModelError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")

        # Every token of a byte-level vocabulary is spelled in GPT-2's byte alphabet; a token that is
        # not (rare, hand-added) is respelled so the BPE model can reach it (as transformers does).
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
            for i, tok in enumerate(tokens)
        }
        pairs: list[tuple[str, str]] = []
        for merge in merges:
            left, space, right = merge.partition(" ")
            if not space:
                raise UnsupportedModelError(f"malformed GGUF merge {merge!r} (expected 'left right')")
            pairs.append((left, right))
        bpe = BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        backend = tokenizers.Tokenizer(bpe)
        add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
        split = _PRE_TOKENIZER_SPLITS[pre]
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        return cls._with_specials(metadata, backend, tokens, alphabet=alphabet)

    @classmethod
    def _with_specials(cls, metadata: Mapping[str, Any], backend: tokenizers.Tokenizer, tokens: list[str], *,
                       alphabet: set[str] | None) -> Tokenizer:
        """The GGUF's special tokens, BOS/EOS insertion and chat template, over a backend that has its vocabulary."""
        token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        # Control tokens are matched whole in the text and skipped by decode(skip_special_tokens=True);
        # in a byte-level vocabulary (`alphabet`), one not spelled in the byte alphabet is a llama.cpp
        # mislabel, left out like transformers does.
        backend.add_special_tokens(
            [
                AddedToken(tok, normalized=False, special=True)
                for tok, kind in zip(tokens, token_types, strict=True)
                if kind == _CONTROL and (alphabet is None or set(tok) <= alphabet)
            ]
        )
        vocab = backend.get_vocab(with_added_tokens=False)
        backend.add_tokens(
            [
                AddedToken(tok, normalized=False, special=False)
                for tok, kind in zip(tokens, token_types, strict=True)
                if kind == _USER_DEFINED and tok in vocab
            ]
        )

        def token(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            if token_id is None:
                return None
            if not 0 <= int(token_id) < len(tokens):
                raise UnsupportedModelError(f"tokenizer.ggml.{key}={token_id} is outside the vocabulary")
            return tokens[int(token_id)]

        bos = token("bos_token_id")
        eos = [t for t in (token("eos_token_id"), token("eot_token_id"), token("eom_token_id")) if t is not None]
        # llama.cpp (and transformers) add BOS to a sentencepiece vocabulary whose file does not say otherwise.
        bos_default = metadata.get("tokenizer.ggml.model") == "llama"
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", bos_default)) and bos is not None
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and bool(eos)
        if add_bos or add_eos:
            # As HF's tokenizer.json does it: a post-processor that wraps the text in BOS/EOS.
            before = [bos] if add_bos and bos is not None else []
            after = eos[:1] if add_eos else []
            backend.post_processor = processors.TemplateProcessing(
                single=[f"{t}:0" for t in before] + ["$A:0"] + [f"{t}:0" for t in after],
                special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(before + after)],
            )
        template = metadata.get("tokenizer.chat_template")
        return cls(
            backend=backend,
            bos_token=bos,
            eos_tokens=eos,
            chat_template=str(template) if template is not None else None,
            extra_special_tokens={"unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")},
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a HF model directory: tokenizer.json, tokenizer_config.json, generation_config.json."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UnsupportedModelError(f"{root} has no tokenizer.json (slow tokenizers are not supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed JSON
            raise UnsupportedModelError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")

        template: Any = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = root / "chat_template.jinja"  # newer transformers save the template beside the config
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        bos = _token_content(config.get("bos_token"))
        eos = [t for t in [_token_content(config.get("eos_token"))] if t is not None]
        # generation_config's eos ids (often several, e.g. <|eot_id|>) also end generation.
        gen_eos = generation.get("eos_token_id")
        for token_id in gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []:
            piece = backend.id_to_token(int(token_id))
            if piece is None:
                raise UnsupportedModelError(f"generation_config eos_token_id {token_id} is not in the vocabulary")
            eos.append(piece)
        return cls(
            backend=backend,
            bos_token=bos,
            eos_tokens=list(dict.fromkeys(eos)),
            chat_template=template if isinstance(template, str) else None,
            extra_special_tokens={
                "unk_token": _token_content(config.get("unk_token")),
                "pad_token": _token_content(config.get("pad_token")),
            },
        )


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """A GGUF `llama` vocabulary (sentencepiece BPE: '▁' for spaces, <0xNN> byte fallback) as transformers'
    GGUF integration rebuilds it: LlamaTokenizer's BPE, with the file's merges or, where it has none (the
    usual case), merges recovered from the token scores best-first (transformers' generate_merges)."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str]]
    if "tokenizer.ggml.merges" in metadata:
        merges = [(left, right) for left, _, right in (m.partition(" ") for m in metadata["tokenizer.ggml.merges"])]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise UnsupportedModelError("GGUF sentencepiece tokenizer has neither merges nor a score per token")
        scored: list[tuple[str, str, float]] = []
        for piece, score in dict(zip(tokens, scores, strict=True)).items():
            splits = [(piece[:i], piece[i:], float(score)) for i in range(1, len(piece))
                      if piece[:i] in vocab and piece[i:] in vocab]
            scored.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
        scored.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        merges = [(left, right) for left, right, _ in scored]
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} is not a JSON object")
    return data


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in: sandboxed (templates come from model files,
    i.e. untrusted), trim_blocks + lstrip_blocks, loop controls, and the same helper globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise UnsupportedModelError(f"the model's chat template does not parse: {exc}") from exc
