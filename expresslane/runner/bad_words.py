"""vLLM's ``bad_words``: a word's last token is -inf when the row's last output tokens are the
rest of the word. ``history`` keeps those tokens on the device: no host sync."""

from __future__ import annotations

import torch

from expresslane.contract import NewRequest
from expresslane.device import to_device
from expresslane.runner.penalties import tracked_samples


class BadWords:
    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows, self.device = max_rows, device
        self.words: dict[int, list[list[int]]] = {}  # row -> its words' token ids
        self.history: torch.Tensor | None = None  # [rows, width] int64, -1 padded
        self.width = 0

    def add(self, row: int, new: NewRequest) -> None:
        self.remove(row)
        words = new.sampling_params.bad_words_token_ids
        if not words:
            return
        self.words[row] = words
        need = max(len(w) for w in words) - 1
        if not need:
            return
        if need > self.width:  # widen, keeping every row's tokens right-aligned
            wider = torch.full((self.max_rows, need), -1, dtype=torch.int64, device=self.device)
            if self.history is not None:
                wider[:, need - self.width:] = self.history
            self.history, self.width = wider, need
        outputs = new.token_ids[new.num_prompt_tokens:][-self.width:]
        self.history[row] = -1
        if outputs:
            self.history[row, self.width - len(outputs):] = to_device(outputs, torch.int64, self.device)

    def remove(self, row: int | None) -> None:
        if row is not None:
            self.words.pop(row, None)

    def sampled(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Shift the sampled tokens into the rows' histories."""
        if self.history is None or not self.words:
            return
        picked = tracked_samples(rows, tokens, self.words, self.device)
        if picked is None:
            return
        r, t = picked
        self.history[r] = torch.cat([self.history[r, 1:], t[:, None].to(torch.int64)], dim=1)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """-inf, in place, on banned tokens (``rows``: the logits' rows)."""
        if not self.words:
            return
        always_i, always_t = [], []  # (logits row, token): banned whatever came before
        cond_i, cond_r, cond_t, prefixes = [], [], [], []
        for i, row in enumerate(rows):
            for word in self.words.get(row, ()):
                if len(word) == 1:
                    always_i.append(i)
                    always_t.append(word[0])
                else:
                    cond_i.append(i)
                    cond_r.append(row)
                    cond_t.append(word[-1])
                    prefixes.append([-2] * (self.width - len(word) + 1) + word[:-1])  # -2: not compared
        dev = logits.device
        if always_i:
            logits[to_device(always_i, torch.int64, dev), to_device(always_t, torch.int64, dev)] = float("-inf")
        if cond_i:
            want = to_device(prefixes, torch.int64, dev)
            match = ((self.history[to_device(cond_r, torch.int64, dev)] == want) | (want == -2)).all(dim=1)
            flat = to_device(cond_i, torch.int64, dev) * logits.shape[1] + to_device(cond_t, torch.int64, dev)
            # add, not set: one word's miss can't undo another's ban
            ban = torch.zeros(len(cond_i), dtype=logits.dtype, device=dev).masked_fill_(match, float("-inf"))
            logits.view(-1).scatter_add_(0, flat, ban)
