"""Expert parallelism: each of the N ranks holds ceil(E/N) whole experts (the last one the rest); tokens go to the ranks of
their experts and their outputs come back (dispatch and combine, two all-to-alls).

Every rank enters with the same T tokens and routing (the router is replicated) and owns
the slice ``[r*S, (r+1)*S)`` of them (S = ceil(T/N), padded). For each (token, slot) of its
slice it sends one row to every rank, at a fixed place (``t*k + j``), with the expert's
local id at the owner and -1 elsewhere: every buffer has a fixed size, so no counts cross
the ranks first and nothing waits on the host (CUDA graphs capture it). The owner computes
the rows it got; the rows go back by the reverse all-to-all, are weighted and summed per
token, and an all-gather of the slices gives every rank all T outputs again.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from expresslane.distributed.group import TPGroup


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, per_rank: int, tp: TPGroup,
                     experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, H], weights/ids [T, k] (global expert ids; rank r holds [r*per_rank, (r+1)*per_rank))
    -> [T, H]; `experts(rows, w, local_ids)` runs this rank's experts (local id -1: skip)."""
    n, (t, h), k = tp.size, x.shape, ids.shape[1]
    s = -(-t // n)
    pad = n * s - t
    mine = slice(tp.rank * s, (tp.rank + 1) * s)
    xs = F.pad(x, (0, 0, 0, pad))[mine]  # [S, H]
    ws = F.pad(weights, (0, 0, 0, pad))[mine]  # padding rows weigh 0
    ids_s = F.pad(ids, (0, 0, 0, pad), value=-1)[mine]  # [S, k]; padding goes nowhere
    owner = torch.div(ids_s, per_rank, rounding_mode="floor")  # -1 for padding
    ranks = torch.arange(n, device=x.device).view(n, 1, 1)
    local = torch.where(owner == ranks, ids_s - ranks * per_rank, -1)  # [N, S, k]
    send_x = xs[None, :, None].expand(n, s, k, h).reshape(-1, h)  # [N * S * k, H]: row t*k + j, for every rank
    recv_x = tp.all_to_all(send_x)
    recv_ids = tp.all_to_all(local.reshape(-1, 1))
    out = experts(recv_x, torch.ones(recv_ids.shape, dtype=torch.float32, device=x.device), recv_ids)
    back = tp.all_to_all(out).view(n, s, k, h)  # rows not computed by a rank are zero
    combined = (back.float().sum(0) * ws.unsqueeze(-1)).sum(1).to(x.dtype)  # [S, H]
    return tp.all_gather_rows(combined)[:t]
