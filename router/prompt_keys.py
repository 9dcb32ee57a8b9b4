"""A request's prompt as the router sees it: chained block digests, an estimated token count, and the
conversation key that rendezvous hashing uses.

The engine's prefix cache keys each full block of `block_size` tokens by a digest chained from its
parent's (engine/kv_cache.py), rooted in the request's `cache_salt`. The router mirrors that shape
without a tokenizer: a prompt given as token ids is cut into blocks of ids exactly as the engine does;
text (a completion prompt, or chat messages rendered in a ChatML-like layout) is cut into blocks of
`block_size * CHARS_PER_TOKEN` characters, about a block of tokens for English text with a BPE
vocabulary. Two prompts that share a text prefix share the blocks it covers, which is all the index
needs: it predicts *which* endpoint holds a prefix and roughly *how much* of it, not the exact count
(the engine reports that in `usage.prompt_tokens_details.cached_tokens`, which the router counts).
The layout is not the model's chat template, so the estimate is off by the template's few tokens a
message; the approximation is documented in docs/routing.md.

Block keys are Python's own `hash()` of (parent key, block bytes): SipHash under a key drawn at
random per process, so a tenant cannot craft a prompt that collides with another's, and cheaper than
a BLAKE2b chain (this runs for every block of every request).
Unlike the engine's SHA-256 keys they guard no K/V, only a routing guess, and they only ever meet keys
of the same process (each router keeps its own index). The conversation key is the one that must be
the same in every router replica, so it is a BLAKE2b digest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

from decodeservice.common.errors import BadRequest

CHARS_PER_TOKEN = 4  # BPE tokenizers average about four characters of English text a token
# Completion prompts have no message structure: their conversation key is the chain digest this many
# blocks in (about 512 tokens), stable across the turns of a conversation once it is that long.
COMPLETION_KEY_BLOCKS = 32
_DIGEST = 16


@dataclasses.dataclass(frozen=True, slots=True)
class PromptKeys:
    blocks: tuple[int, ...]  # chained keys of the prompt's full blocks, first block first
    tokens: int  # the prompt's token count (exact for token ids, estimated for text)
    block_tokens: int  # tokens a block stands for
    conversation: bytes  # what two routers hash with each endpoint to agree on a cold prefix


@functools.lru_cache(maxsize=4096)  # one per tenant: computed once, and its hash() cached with it
def root_digest(salt: str | None) -> bytes:
    """The chain's root: tenants with different salts (isolatePrefixCache) never share a key."""
    tagged = b"\x00" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(b"decodeservice.router.v1" + tagged, digest_size=_DIGEST).digest()


def _digest(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(parent + data, digest_size=_DIGEST).digest()


def _text_blocks(text: str, *, root: bytes, block_chars: int) -> list[int]:
    data = text.encode("utf-8", "surrogatepass")
    # Bytes, not characters, so every block has the same size whatever the script; a multi-byte
    # character split at a boundary is still the same bytes in every prompt that shares the prefix.
    parent, out = hash(root), []
    for start in range(0, len(data) - block_chars + 1, block_chars):
        parent = hash((parent, data[start:start + block_chars]))
        out.append(parent)
    return out


def _id_blocks(ids: Sequence[int], *, root: bytes, block_size: int) -> list[int]:
    parent, out = hash(root), []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start:start + block_size])))
        out.append(parent)
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _render_message(message: Any) -> str:
    if not isinstance(message, dict):
        raise BadRequest("each of `messages` must be an object", param="messages", reason="invalid_field")
    return f"<|im_start|>{message.get('role', '')}\n{_content_text(message.get('content'))}<|im_end|>\n"


def prompt_keys(body: dict[str, Any], *, block_size: int, salt: str | None) -> PromptKeys:
    """The keys of a chat (`messages`) or completion (`prompt`) body; 400 for a prompt of the wrong shape."""
    root = root_digest(salt)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list", param="messages", reason="invalid_field")
        rendered = [_render_message(m) for m in messages]
        # A conversation is its messages up to its first user turn (the system prompt and the document
        # the user opened with): every later turn starts with them.
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
        conversation = _digest(root, "".join(rendered[:first_user + 1]).encode("utf-8", "surrogatepass"))
        text = "".join(rendered)
        blocks = _text_blocks(text, root=root, block_chars=block_size * CHARS_PER_TOKEN)
        return PromptKeys(blocks=tuple(blocks), tokens=math.ceil(len(text) / CHARS_PER_TOKEN),
                          block_tokens=block_size, conversation=conversation)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        blocks = _id_blocks(prompt, root=root, block_size=block_size)
        tokens = len(prompt)
    elif isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
        text = prompt if isinstance(prompt, str) else "\n".join(prompt)
        blocks = _text_blocks(text, root=root, block_chars=block_size * CHARS_PER_TOKEN)
        tokens = math.ceil(len(text) / CHARS_PER_TOKEN)
    else:
        raise BadRequest("`prompt` must be a string, a list of strings, or token ids", param="prompt",
                         reason="invalid_field")
    # The same in every router: a digest of the text (or ids) of its first blocks, not a process's hash().
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        opening = repr(prompt[: COMPLETION_KEY_BLOCKS * block_size]).encode()
    else:
        text = prompt if isinstance(prompt, str) else "\n".join(prompt)
        opening = text.encode("utf-8", "surrogatepass")[: COMPLETION_KEY_BLOCKS * block_size * CHARS_PER_TOKEN]
    conversation = _digest(root, opening)
    return PromptKeys(blocks=tuple(blocks), tokens=tokens, block_tokens=block_size, conversation=conversation)
