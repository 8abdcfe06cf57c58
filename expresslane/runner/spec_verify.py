"""Verifying speculated tokens: one target step computed logits at a request's last token and
at each of its k proposals; this keeps the longest accepted run of proposals and adds one
token of the target's own, so every step yields 1 to k + 1 tokens.

- Greedy (temperature 0): a proposal is accepted while it equals the target's argmax; the
  token added is the argmax after the last accepted one. The output is exactly what
  decoding one token at a time gives.
- Sampling: speculative sampling (Leviathan et al. 2023; Chen et al. 2023). Proposal d drawn
  from q is accepted with probability min(1, p(d) / q(d)), p being the target's distribution
  after temperature, top_k, top_p and min_p; at the first rejection the token is drawn from
  max(p - q, 0) renormalised, and after k acceptances from p at the last position. Each
  token is then distributed exactly as p. Prompt lookup (ngram) proposals are deterministic:
  q is one-hot, so d is accepted with probability p(d) and a rejection draws from p without d.
  Draws come from the engine's generator (seeded sampling requests do not speculate).
"""

from __future__ import annotations

import numpy as np
import torch

from expresslane.device import to_device
from expresslane.runner.sampler import filter_logits
from expresslane.sampling_params import SamplingParams


def verify(logits: torch.Tensor, counts: np.ndarray, drafts: torch.Tensor, params: list[SamplingParams],
           generator: torch.Generator, draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [sum(counts + 1), V] float32: each seq's k + 1 rows in order; counts [S] its k;
    drafts [S, K] its proposals (padded); draft_probs [S, K, V] the draft's q, or None (ngram).
    Returns (tokens [S, K + 1] padded with -1, number of tokens [S]) on the device."""
    dev = logits.device
    num, width = len(counts), int(counts.max()) + 1  # every seq here proposes at least one token
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    cols = np.arange(width)
    rows = starts[:, None] + np.minimum(cols[None, :], counts[:, None])  # padding repeats the last row
    logits = logits[to_device(rows.reshape(-1), torch.int64, dev)].view(num, width, -1)
    valid = to_device(cols[None, :width - 1] < counts[:, None], torch.bool, dev)  # [S, K]
    drafts = drafts[:, :width - 1].clamp(min=0)
    greedy = [p.greedy for p in params]
    target = logits.argmax(dim=-1)  # [S, K + 1]
    accept = valid & (drafts == target[:, :-1])
    if not all(greedy):
        temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
        flat = filter_logits((logits / temps[:, None, None]).view(num * width, -1),
                             [p for p in params for _ in range(width)])
        probs = flat.softmax(dim=-1).view(num, width, -1)
        uniform = torch.rand(num, width - 1, device=dev, generator=generator)
        noise = torch.empty(num, probs.shape[-1], device=dev).exponential_(generator=generator)
        p_draft = probs[:, :-1].gather(2, drafts[..., None]).squeeze(2)  # p(d) [S, K]
        if draft_probs is None:
            ratio = p_draft
        else:
            q_draft = draft_probs[:, :width - 1].gather(2, drafts[..., None]).squeeze(2)
            ratio = p_draft / q_draft.clamp(min=1e-30)
        sampled_accept = valid & (uniform < ratio)
        is_greedy = to_device(greedy, torch.bool, dev)[:, None]
        accept = torch.where(is_greedy, accept, sampled_accept)
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # [S]
    at = num_accepted[:, None]
    final = target.gather(1, at).squeeze(1)
    if not all(greedy):
        p_at = probs.gather(1, at[..., None].expand(-1, -1, probs.shape[-1])).squeeze(1)  # [S, V]
        rejected = num_accepted < to_device(counts, torch.int64, dev)
        if draft_probs is None:
            q_at = torch.zeros_like(p_at).scatter_(1, drafts.gather(1, at.clamp(max=width - 2)), 1.0)
        else:
            q_at = draft_probs.gather(1, at.clamp(max=width - 2)[..., None].expand(-1, -1, p_at.shape[-1])).squeeze(1)
        residual = torch.where(rejected[:, None], (p_at - q_at).clamp(min=0), p_at)
        empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: a rejection had probability 0
        residual = torch.where(empty, p_at, residual)
        drawn = (residual / noise).argmax(dim=-1)
        final = torch.where(to_device(greedy, torch.bool, dev), final, drawn)
    tokens = torch.where(torch.arange(width, device=dev)[None, :] < at, torch.cat(
        [drafts, drafts.new_zeros(num, 1)], dim=1), torch.full_like(target, -1))
    tokens.scatter_(1, at, final[:, None])
    return tokens, num_accepted + 1
