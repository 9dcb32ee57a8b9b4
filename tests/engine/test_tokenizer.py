"""engine/tokenizer: ours must tokenize, decode and render chats exactly as transformers does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from decodeservice.engine.errors import UnsupportedModelError
from decodeservice.engine.loader.gguf_loader import read_gguf_tokenizer
from decodeservice.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing ",
    "a  b   c\n\n\t x\r\n",
    "naïve café, Ünïcödé: 日本語のテキスト 🤖👍🏽 ‰ € \u00a0nbsp\u2003em",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "12345 3.14159 1e-9 0xFF 1,000,000 2024-01-31",
    "I'm sure you're right; we'll see. DON'T SHOUT",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "inline<|im_end|>tokens<|im_start|>glued<|endoftext|>",
    "almost <|im_start| special <im_end|>",
    "",
    "   ",
    "\n",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and  3+3 ?\n"},
    ],
    [{"role": "user", "content": "unicode ✓ and <|im_end|> inside"}],
]


@pytest.fixture(scope="session")
def ours(bundled_gguf_path: Path) -> Tokenizer:
    return read_gguf_tokenizer(bundled_gguf_path)


@pytest.fixture(scope="session")
def theirs(bundled_gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bundled_gguf_path.parent), gguf_file=bundled_gguf_path.name)


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, theirs: Any, text: str) -> None:
    assert ours.encode(text) == theirs(text)["input_ids"]


@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips_and_matches_transformers(ours: Tokenizer, theirs: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE loses nothing
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.model
def test_special_tokens(ours: Tokenizer) -> None:
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.vocab_size == 49152
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    assert ours.encode("hello")[0] != ours.bos_token_id  # SmolLM2 adds no BOS
    assert ours.decode([1, *ours.encode("hi"), 2]) == "hi"
    assert ours.id_to_piece(ours.encode(" the")[0]) == "Ġthe"
    assert {0, 1, 2} <= ours.special_token_ids
    with pytest.raises(IndexError):
        ours.id_to_piece(10**6)


@pytest.mark.model
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, theirs: Any, chat: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    rendered = ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
    assert ours.encode(rendered, add_special_tokens=False) == list(ids)


@pytest.mark.model
def test_template_environment_is_sandboxed_and_has_helpers(ours: Tokenizer) -> None:
    def with_template(template: str) -> Tokenizer:
        return Tokenizer(backend=ours.backend, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"],
                         chat_template=template)

    helpers = with_template("{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}\n  {% if true %}\n  x{% endif %}")
    # tojson does not HTML-escape; trim_blocks/lstrip_blocks eat the tag lines as in transformers.
    assert helpers.apply_chat_template([{"role": "user", "content": "<&>"}]) == (
        '<|im_start|>|<|im_end|>|[{"role": "user", "content": "<&>"}]\n  x'
    )
    failing = with_template("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        failing.apply_chat_template([])
    escaping = with_template("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        escaping.apply_chat_template([])
    with pytest.raises(UnsupportedModelError, match="chat template"):
        with_template(None).apply_chat_template([])  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="does not parse"):
        with_template("{% for %}").apply_chat_template([])


def test_gguf_tokenizer_rejects_unsupported_kinds() -> None:
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1]}
    assert Tokenizer.from_gguf_metadata(base).encode("abab") == [2, 2]
    with pytest.raises(UnsupportedModelError, match="'t5'"):
        Tokenizer.from_gguf_metadata(base | {"tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'chatglm-bpe'"):
        Tokenizer.from_gguf_metadata(base | {"tokenizer.ggml.pre": "chatglm-bpe"})
    with pytest.raises(UnsupportedModelError, match="outside the vocabulary"):
        Tokenizer.from_gguf_metadata(base | {"tokenizer.ggml.eos_token_id": 7})


def write_hf_tokenizer(path: Path) -> None:
    """A Llama-3-like tokenizer.json (byte-level BPE, BOS added by the post-processor) and its config."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l")]
    vocab = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges]
    backend = Backend(BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    backend.save(str(path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | trim }}"
                "{{ '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True}, "chat_template": template,
    }))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))


def test_hf_dir_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_hf_tokenizer(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (1, 2)  # eos, then generation_config's <|eot_id|>
    for text in ["the hell", " the  the\n", "<|eot_id|>then", "ünï 🙂", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"], text  # BOS from the post-processor
        assert ours.encode(text)[:1] == [0]
        assert ours.decode(ours.encode(text)) == theirs.decode(ours.encode(text), skip_special_tokens=True)
    chat = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_hf_dir_without_tokenizer_json_is_unsupported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="cannot read"):
        Tokenizer.from_hf_dir(tmp_path)
