"""Presence, frequency and repetition penalties (vLLM's meanings) from per-row token counts on
the device."""

from __future__ import annotations

import torch

from expresslane.device import to_device
from expresslane.contract import NewRequest
from expresslane.sampling_params import SamplingParams

def tracked_samples(rows: list[int], tokens: torch.Tensor, tracked, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, their sampled tokens) on the device for the rows in ``tracked``; None if none is."""
    pick = [i for i, row in enumerate(rows) if row in tracked]
    if not pick:
        return None
    return to_device([rows[i] for i in pick], torch.int64, device), tokens[to_device(pick, torch.int64, device)]



class Penalties:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32, allocated at first use
        self.seen: torch.Tensor | None = None  # [rows, vocab] uint8 (0 or 1)
        self.params: dict[int, SamplingParams] = {}  # penalized rows

    def add(self, row: int, new: NewRequest) -> None:
        self.remove(row)
        if not new.sampling_params.penalized:
            return
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.seen = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.uint8, device=self.device)
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.params[row] = new.sampling_params
        if new.token_ids:
            self.seen[row, to_device(new.token_ids, torch.int64, self.device)] = 1
        outputs = new.token_ids[new.num_prompt_tokens:]
        if outputs:
            self.counts[row].scatter_add_(0, to_device(outputs, torch.int64, self.device),
                                          torch.ones(len(outputs), dtype=torch.int32, device=self.device))

    def remove(self, row: int | None) -> None:
        if row is not None:
            self.params.pop(row, None)

    def sampled(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Count the sampled tokens of the penalized rows."""
        if not self.params:
            return
        picked = tracked_samples(rows, tokens, self.params, self.device)
        if picked is None:
            return
        r, t = picked
        flat = r * self.vocab_size + t  # not index_put_(accumulate=True): no host sync
        self.counts.view(-1).scatter_add_(0, flat, torch.ones(len(r), dtype=torch.int32, device=self.device))
        self.seen.view(-1).scatter_(0, flat, 1)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """In place, the penalized rows' logits."""
        if not self.params:
            return
        pick = [i for i, row in enumerate(rows) if row in self.params]
        if not pick:
            return
        dev = self.device
        idx = to_device(pick, torch.int64, dev)
        r = to_device([rows[i] for i in pick], torch.int64, dev)
        params = [self.params[rows[i]] for i in pick]
        rep, freq, pres = (to_device([getattr(p, name) for p in params], torch.float32, dev)
                           for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        if logits.is_cuda and logits.dtype == torch.float32:
            from expresslane.runner.penalty_kernel import penalize  # Triton: imported where it runs

            penalize(logits, self.counts, self.seen, idx, r, rep, freq, pres)
            return
        rep, freq, pres = rep[:, None], freq[:, None], pres[:, None]
        sub, counts, seen = logits[idx], self.counts[r], self.seen[r] != 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        logits[idx] = sub - freq * counts - pres * (counts > 0)
