"""Batched sampling, vLLM's meanings. A draw is argmax(p / E), E ~ Exp(1); a seeded request
draws E from its own generator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from expresslane.device import to_device
from expresslane.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    params: list[SamplingParams]
    banned: list[tuple[int, ...]]  # per row: tokens it may not sample now
    generators: list[torch.Generator | None]  # None: the shared generator
    # int32 [rows, ceil(vocab / 32)], allowed tokens
    bitmask: np.ndarray | None = None
    # runner/penalties.py
    penalize: Callable[[torch.Tensor], None] | None = None
    # runner/bad_words.py
    ban_words: Callable[[torch.Tensor], None] | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[torch.Tensor, list[dict[int, float]] | None]:
        """logits [B, V] float32 -> (token ids [B] on the device, per-row logprobs or None);
        no host sync."""
        dev = logits.device
        apply_token_controls(logits, batch.params)
        if batch.penalize is not None:
            batch.penalize(logits)
        if batch.ban_words is not None:
            batch.ban_words(logits)
        if batch.bitmask is not None:
            apply_token_bitmask(logits, to_device(batch.bitmask, torch.int32, dev))
        banned = [(i, t) for i, toks in enumerate(batch.banned) for t in toks]
        if banned:
            rows, cols = zip(*banned)
            logits[to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev)] = float("-inf")
        wants_logprobs = any(p.logprobs is not None for p in batch.params)
        lp = torch.log_softmax(logits, dim=-1) if wants_logprobs else None  # once, for top-k and chosen
        logprobs = self._logprobs(lp, batch) if wants_logprobs else None
        greedy = [p.greedy for p in batch.params]
        if all(greedy):
            out = logits.argmax(dim=-1)
        else:
            temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in batch.params], torch.float32, dev)
            probs = filter_logits(logits / temps[:, None], batch.params).softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, gen in enumerate(batch.generators):
                if gen is not None:  # seeded: its own stream
                    noise[i].exponential_(generator=gen)
            sampled = (probs / noise).argmax(dim=-1)
            out = sampled if not any(greedy) else torch.where(to_device(greedy, torch.bool, dev),
                                                              logits.argmax(dim=-1), sampled)
        if logprobs is not None:
            chosen = lp.gather(1, out[:, None]).squeeze(1).tolist()
            for i, tok in enumerate(out.tolist()):
                if logprobs[i] is not None:
                    logprobs[i][tok] = chosen[i]
        return out, logprobs

    @staticmethod
    def _logprobs(lp: torch.Tensor, batch: SamplingBatch) -> list[dict[int, float] | None]:
        """Top `logprobs` of the raw distribution (before temperature, filters)."""
        wanted = [p.logprobs for p in batch.params]
        k_max = max(k for k in wanted if k is not None)
        if k_max:
            top = lp.topk(k_max, dim=-1)
            ids, values = top.indices.tolist(), top.values.tolist()
        out: list[dict[int, float] | None] = []
        for i, k in enumerate(wanted):
            if k is None:
                out.append(None)
            elif k == 0:
                out.append({})
            else:
                out.append(dict(zip(ids[i][:k], values[i][:k])))
        return out


def apply_token_controls(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Apply ``allowed_token_ids`` and ``logit_bias`` in place."""
    rows, cols, values = [], [], []
    allowed_rows, allowed_cols = [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
        if p.allowed_token_ids is not None:
            allowed_rows += [i] * len(p.allowed_token_ids)
            allowed_cols += p.allowed_token_ids
    dev = logits.device
    if allowed_rows:
        restricted = sorted(set(allowed_rows))
        local = {row: k for k, row in enumerate(restricted)}
        block = torch.full((len(restricted), logits.shape[1]), float("-inf"), device=dev)
        block[to_device([local[r] for r in allowed_rows], torch.int64, dev), to_device(allowed_cols, torch.int64, dev)] = 0
        logits[to_device(restricted, torch.int64, dev)] += block
    if rows:
        logits.index_put_((to_device(rows, torch.int64, dev), to_device(cols, torch.int64, dev)),
                          to_device(values, torch.float32, dev), accumulate=True)


_BITS = {}  # device -> arange(32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, where the bit is 0 (token 32w + j: bit j of word w)."""
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :logits.shape[-1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def bitmask_rows(token_bitmask: np.ndarray, rows: list[int]) -> np.ndarray | None:
    """``rows``: plan rows, -1 for none; None if none constrained."""
    if all(r < 0 for r in rows):
        return None
    out = np.full((len(rows), token_bitmask.shape[1]), -1, dtype=np.int32)
    for k, r in enumerate(rows):
        if r >= 0:
            out[k] = token_bitmask[r]
    return out


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """-inf outside top_k, top_p and min_p."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = to_device([k if 0 < k < vocab else vocab for k in top_k], torch.int64, logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        p = to_device(top_p, torch.float32, logits.device)
        # the smallest prefix reaching top_p
        drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        m = to_device(min_p, torch.float32, logits.device)
        logits = logits.masked_fill(probs < m[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits
