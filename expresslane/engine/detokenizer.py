"""Incremental detokenization and stop strings (frontend side, per completion).

Text is emitted only once it is stable: the newest tokens are decoded together with
a few earlier ones (the window `ids[prefix:]`), and the part beyond the decode of
`ids[prefix:read]` is new text unless it ends in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (spaces, merges)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self.text = ""
        self._stop_scan_from = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string if one now appears (text is cut there)."""
        for tok in token_ids:
            self._ids.append(tok)
            before = self._decode(self._ids[self._prefix:self._read])
            window = self._decode(self._ids[self._prefix:])
            if len(window) > len(before) and not window.endswith("\ufffd"):
                self.text += window[len(before):]
                self._prefix, self._read = self._read, len(self._ids)
        return self._check_stop() if self.stop else None

    def _check_stop(self) -> str | None:
        text = self.text
        longest = max(len(s) for s in self.stop)
        start = max(0, self._stop_scan_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        self._stop_scan_from = len(text)
        if best is None:
            return None
        i, s = best
        self.text = text[:i + len(s)] if self.include_stop else text[:i]
        return s
