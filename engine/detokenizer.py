"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: a trailing replacement character (half of a multi-byte
UTF-8 character) is held back, and so is any tail that could still grow into a stop string.

Each step decodes only a short window of tokens, not the whole output (which would make a request's
detokenization quadratic in its length): the text of tokens[prefix:] minus the text of
tokens[prefix:read]. Decoding a window that starts a few tokens back, rather than the new tokens alone,
keeps the spaces and merges that depend on the previous token (SentencePiece-style decoders drop a
leading space at the start of a decode).
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
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # what has been emitted so far
        self._full = ""  # the decoded text of tokens[:read_offset]
        self._prefix_offset = 0  # start of the context window decoded again for the next tokens
        self._read_offset = 0  # tokens before this are in _full
        self._stopped = False

    def _decode_new(self, token_ids: Seq[int], *, flush: bool) -> str:
        """The full text so far; tokens ending in half a UTF-8 character wait unless `flush`."""
        if len(token_ids) > self._read_offset:
            decode = self.tokenizer.decode
            window = list(token_ids[self._prefix_offset :])
            known = decode(window[: self._read_offset - self._prefix_offset], skip_special_tokens=True)
            grown = decode(window, skip_special_tokens=True)
            if flush or (len(grown) > len(known) and not grown.endswith("\ufffd")):
                self._full += grown[len(known) :]
                self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        return self._full

    def update(self, token_ids: Seq[int], *, finished: bool) -> tuple[str, bool]:
        """New stable text since the last call, and whether a stop string was hit. `token_ids` is the
        whole output so far; it only ever grows."""
        if self._stopped:
            return "", True
        full = self._decode_new(token_ids, flush=finished)
        if self.stop:
            search_from = max(len(self.text) - self.hold, 0)
            hits = [(full.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                self._stopped = True
                end = index + len(stop) if self.include_stop else index
                return self._emit(full[:end]), True
        if finished:
            return self._emit(full), False
        stable = len(full)
        while stable > 0 and full[stable - 1] == "\ufffd":
            stable -= 1
        stable = max(min(stable, len(full) - self.hold), len(self.text))
        return self._emit(full[:stable]), False

    def _emit(self, text: str) -> str:
        new = text[len(self.text) :]
        self.text = text
        return new
