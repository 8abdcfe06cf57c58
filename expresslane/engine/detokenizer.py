"""Incremental detokenization and stop strings, per completion. New text: the decoding of
`ids[prefix:]` past that of `ids[prefix:read]`, held while it ends in an incomplete UTF-8
sequence; `tokenizers`' `DecodeStream` runs it in Rust where it gives the same text."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context


class StopStrings:
    """Matched in O(new characters × distinct lengths) per step."""

    def __init__(self, stop: list[str]):
        self.rank: dict[str, int] = {}  # string -> first position (ties: the earlier wins)
        for i, s in enumerate(stop):
            self.rank.setdefault(s, i)
        self.lengths = sorted({len(s) for s in self.rank}, reverse=True)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The earliest-starting stop string ending after ``text[:new_from]``."""
        best: tuple[int, int, str] | None = None  # (start, rank, string)
        for end in range(new_from + 1, len(text) + 1):
            for n in self.lengths:
                start = end - n
                if start < 0:
                    continue
                if best is not None and start > best[0]:
                    break
                s = text[start:end]
                rank = self.rank.get(s)
                if rank is not None and (best is None or (start, rank) < best[:2]):
                    best = (start, rank, s)
        return None if best is None else (best[0], best[2])


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: StopStrings | None, skip_special_tokens: bool,
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
        self._stream = _decode_stream(tokenizer, context, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str | None:
        """The stop string if one now appears (text is cut there)."""
        if self._stream is not None:
            backend, stream = self._stream
            for tok in token_ids:
                piece = stream.step(backend, tok)
                if piece is not None:
                    self.text += piece
        else:
            for tok in token_ids:
                self._ids.append(tok)
                before = self._decode(self._ids[self._prefix:self._read])
                window = self._decode(self._ids[self._prefix:])
                if len(window) > len(before) and not window.endswith("\ufffd"):
                    self.text += window[len(before):]
                    self._prefix, self._read = self._read, len(self._ids)
        return self._check_stop() if self.stop is not None else None

    def _check_stop(self) -> str | None:
        text = self.text
        found = self.stop.find(text, self._stop_scan_from)
        self._stop_scan_from = len(text)
        if found is None:
            return None
        i, s = found
        self.text = text[:i + len(s)] if self.include_stop else text[:i]
        return s


def _decode_stream(tokenizer, context: list[int], skip_special_tokens: bool) -> tuple[Tokenizer, DecodeStream] | None:
    """A primed DecodeStream where it matches the Python path (Rust tokenizer, no clean-up,
    a context that decodes cleanly), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    head = backend.decode(context, skip_special_tokens=skip_special_tokens)
    if not head or head.endswith("\ufffd"):
        return None
    return backend, DecodeStream(context, skip_special_tokens)
