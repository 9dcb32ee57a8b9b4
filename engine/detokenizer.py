"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: a trailing replacement character (half of a multi-byte
UTF-8 character) is held back, and so is any tail that could still grow into a stop string.
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
        self._full = ""
        self._stopped = False

    def update(self, token_ids: Seq[int], *, finished: bool) -> tuple[str, bool]:
        """New stable text since the last call, and whether a stop string was hit."""
        if self._stopped:
            return "", True
        full = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self._full = full
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
