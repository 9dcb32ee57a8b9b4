"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: a trailing replacement character (half of a multi-byte
UTF-8 character) is held back, and so is any tail that could still grow into a stop string.

Each step costs what it adds, never the output so far (which would make a request's detokenization
quadratic in its length):
- it decodes only a short window of tokens: the text of tokens[prefix:] minus the text of
  tokens[prefix:read]. Decoding a window that starts a few tokens back, rather than the new tokens
  alone, keeps the spaces and merges that depend on the previous token (SentencePiece-style decoders
  drop a leading space at the start of a decode);
- it searches for stop strings only in the text not emitted yet (`_pending`): holding back the last
  `hold` characters means a stop string that shows up now cannot have begun in text already emitted
  (it would have been seen whole a step earlier). The emitted pieces are joined once, when `text` is
  read.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from decodeservice.engine.sampling_params import SamplingParams
from decodeservice.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens  # stop strings count only from this many tokens on, as in vLLM
        self.skip_special = params.skip_special_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._emitted: list[str] = []  # the text emitted so far, in pieces
        self._pending = ""  # decoded, not emitted yet
        self._prefix_offset = 0  # start of the context window decoded again for the next tokens
        self._read_offset = 0  # tokens before this are decoded (emitted or pending)
        self._stopped = False

    @property
    def text(self) -> str:
        """What has been emitted so far."""
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def _decode_new(self, token_ids: Seq[int], *, flush: bool) -> None:
        """Move the new tokens' text to `_pending`; tokens ending in half a UTF-8 character wait unless
        `flush`."""
        if len(token_ids) > self._read_offset:
            decode = self.tokenizer.decode
            window = list(token_ids[self._prefix_offset :])
            known = decode(window[: self._read_offset - self._prefix_offset], skip_special_tokens=self.skip_special)
            grown = decode(window, skip_special_tokens=self.skip_special)
            if flush or (len(grown) > len(known) and not grown.endswith("\ufffd")):
                self._pending += grown[len(known) :]
                self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)

    def update(self, token_ids: Seq[int], *, finished: bool) -> tuple[str, bool]:
        """New stable text since the last call, and whether a stop string was hit. `token_ids` is the
        whole output so far; it only ever grows (only its last few tokens are read)."""
        if self._stopped:
            return "", True
        self._decode_new(token_ids, flush=finished)
        pending = self._pending
        if self.stop and len(token_ids) >= self.min_tokens:
            hits = [(i, s) for i, s in ((pending.find(s), s) for s in self.stop) if i >= 0]
            if hits:
                index, stop = min(hits)
                self._stopped = True
                end = index + len(stop) if self.include_stop else index
                return self._emit(end), True
        if finished:
            return self._emit(len(pending)), False
        stable = len(pending)
        while stable > 0 and pending[stable - 1] == "\ufffd":
            stable -= 1
        return self._emit(max(min(stable, len(pending) - self.hold), 0)), False

    def _emit(self, num_chars: int) -> str:
        """Hand out the first `num_chars` of the pending text."""
        new, self._pending = self._pending[:num_chars], self._pending[num_chars:]
        if new:
            self._emitted.append(new)
        return new
