"""Verifying proposals: the longest accepted run plus one target token."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from expresslane.device import to_device
from expresslane.runner.sampler import filter_logits
from expresslane.sampling_params import SamplingParams


class Verified:
    """Device `tensors` and how they become tokens."""

    def __init__(self, tensors: list[torch.Tensor], finish: Callable[[list[np.ndarray]], list[list[int]]]):
        self.tensors, self._finish = tensors, finish

    def tokens(self, host: list[np.ndarray] | None = None) -> list[list[int]]:
        return self._finish([t.cpu().numpy() for t in self.tensors] if host is None else host)


def accept_greedy(target: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """Proposals while each equals the target argmax (target [S, W]), then the next argmax."""
    width = target.shape[1]
    match = (drafts[:, :width - 1] == target[:, :-1]) & (np.arange(width - 1)[None, :] < counts[:, None])
    accepted = np.cumprod(match, axis=1).sum(axis=1)
    return [[*d[:a].tolist(), int(t[a])] for d, t, a in zip(drafts, target, accepted)]


def verify(logits: torch.Tensor, counts: np.ndarray, drafts: np.ndarray | torch.Tensor, params: list[SamplingParams],
           generator: torch.Generator, draft_probs: torch.Tensor | None = None) -> Verified:
    """logits [S, k + 1, V], padded by each seq's last row; draft_probs None: one-hot."""
    num, width = len(counts), logits.shape[1]
    if all(p.greedy for p in params):
        target = logits.argmax(dim=-1)
        if isinstance(drafts, torch.Tensor):
            return Verified([target, drafts], lambda host: accept_greedy(host[0], host[1], counts))
        return Verified([target], lambda host: accept_greedy(host[0], drafts, counts))
    dev = logits.device
    if not isinstance(drafts, torch.Tensor):
        drafts = to_device(drafts, torch.int64, dev)
    cols = np.arange(width)
    valid = to_device(cols[None, :width - 1] < counts[:, None], torch.bool, dev)
    drafts = drafts[:, :width - 1].clamp(min=0)
    greedy = [p.greedy for p in params]
    target = logits.argmax(dim=-1)
    temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, dev)
    flat = filter_logits((logits / temps[:, None, None]).view(num * width, -1),
                         [p for p in params for _ in range(width)])
    probs = flat.softmax(dim=-1).view(num, width, -1)
    uniform = torch.rand(num, width - 1, device=dev, generator=generator)
    noise = torch.empty(num, probs.shape[-1], device=dev).exponential_(generator=generator)
    p_draft = probs[:, :-1].gather(2, drafts[..., None]).squeeze(2)  # p(d)
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs[:, :width - 1].gather(2, drafts[..., None]).squeeze(2)
        ratio = p_draft / q_draft.clamp(min=1e-30)
    is_greedy = to_device(greedy, torch.bool, dev)
    accept = torch.where(is_greedy[:, None], valid & (drafts == target[:, :-1]), valid & (uniform < ratio))
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    at = num_accepted[:, None]
    p_at = probs.gather(1, at[..., None].expand(-1, -1, probs.shape[-1])).squeeze(1)
    rejected = num_accepted < to_device(counts, torch.int64, dev)
    if draft_probs is None:
        q_at = torch.zeros_like(p_at).scatter_(1, drafts.gather(1, at.clamp(max=width - 2)), 1.0)
    else:
        q_at = draft_probs.gather(1, at.clamp(max=width - 2)[..., None].expand(-1, -1, p_at.shape[-1])).squeeze(1)
    residual = torch.where(rejected[:, None], (p_at - q_at).clamp(min=0), p_at)
    empty = residual.sum(dim=1, keepdim=True) <= 0  # p == q: a rejection had probability 0
    residual = torch.where(empty, p_at, residual)
    final = torch.where(is_greedy, target.gather(1, at).squeeze(1), (residual / noise).argmax(dim=-1))
    tokens = torch.where(torch.arange(width, device=dev)[None, :] < at, torch.cat(
        [drafts, drafts.new_zeros(num, 1)], dim=1), torch.full_like(target, -1))
    tokens.scatter_(1, at, final[:, None])
    return Verified([tokens, num_accepted + 1],
                    lambda host: [row[:n].tolist() for row, n in zip(host[0], host[1])])
