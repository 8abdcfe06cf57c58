"""Prompt logprobs, in eager steps, a slice of rows at a time."""

from __future__ import annotations

import numpy as np
import torch

from expresslane.device import to_device
from expresslane.contract import ScoredPrompt
from expresslane.runner.request_rows import StepInputs

ROWS_PER_SLICE = 256  # positions whose full-vocabulary logits exist at once


def scored_rows(inputs: StepInputs) -> tuple[np.ndarray, list[int], list[int]] | None:
    """(scoring token indices, their targets, each row's seq); None if no seq asks."""
    rows, targets, owners = [], [], []
    for i, seq in enumerate(inputs.seqs):
        if seq.prompt_logprob_targets:
            first = int(inputs.query_start_loc[i]) + seq.prompt_logprobs_from
            rows.append(np.arange(first, first + len(seq.prompt_logprob_targets)))
            targets += seq.prompt_logprob_targets
            owners += [i] * len(seq.prompt_logprob_targets)
    if not rows:
        return None
    return np.concatenate(rows), targets, owners


def forward_scoring(model, input_ids: torch.Tensor, positions: torch.Tensor, meta, inputs: StepInputs,
                    scored: tuple[np.ndarray, list[int], list[int]], top_k: list[int]
                    ) -> tuple[torch.Tensor | None, dict[str, ScoredPrompt]]:
    """(sampling seqs' logits or None, prompt logprobs by request)."""
    hidden = model(input_ids, positions, meta)
    last = (inputs.query_start_loc[1:] - 1)[inputs.sampling]
    logits = model.compute_logits(hidden[to_device(last, torch.int64, hidden.device)]) if len(last) else None
    return logits, score(model, hidden, *scored, top_k, [s.request_id for s in inputs.seqs])


def score(model, hidden: torch.Tensor, rows: np.ndarray, targets: list[int], owners: list[int],
          top_k: list[int], seq_ids: list[str]) -> dict[str, ScoredPrompt]:
    """Per request: each row's target logprob, rank and top `top_k[seq]`."""
    dev = hidden.device
    k_max = max(top_k[i] for i in set(owners))
    target = to_device(targets, torch.int64, dev)
    where = to_device(rows, torch.int64, dev)
    chosen, ranks, top_v, top_i = [], [], [], []
    for s in range(0, len(rows), ROWS_PER_SLICE):
        lp = torch.log_softmax(model.compute_logits(hidden[where[s:s + ROWS_PER_SLICE]]), dim=-1)
        mine = lp.gather(1, target[s:s + ROWS_PER_SLICE, None])
        chosen.append(mine.squeeze(1))
        ranks.append((lp >= mine).sum(dim=-1))  # vLLM's rank: tokens at least as likely
        if k_max:
            top = lp.topk(k_max, dim=-1)
            top_v.append(top.values)
            top_i.append(top.indices)
    chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    top_vl = torch.cat(top_v).tolist() if k_max else None
    top_il = torch.cat(top_i).tolist() if k_max else None
    out: dict[str, ScoredPrompt] = {}
    for j, owner in enumerate(owners):
        got = out.get(seq_ids[owner])
        if got is None:
            got = out[seq_ids[owner]] = ScoredPrompt()
        k = top_k[owner]
        got.logprobs.append(chosen_l[j])
        got.ranks.append(ranks_l[j])
        got.top_ids.append(top_il[j][:k] if k else [])
        got.top_logprobs.append(top_vl[j][:k] if k else [])
    return out
