"""Embeddings: each pooling request's vector from its chunks' final hidden states (LAST: the last
token's; MEAN: their sum over the prompt length; CLS: the first token's), then `dimensions` and
normalisation (docs/architecture.md, data flow)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expresslane.pooling_params import PoolingParams
from expresslane.runner.request_rows import StepInputs


class PooledVectors:
    """Row i: request_ids[i]'s vector, its first lengths[i] values."""

    def __init__(self, request_ids: list[str], vectors: torch.Tensor, lengths: list[int]):
        self.request_ids, self.vectors, self.lengths = request_ids, vectors, lengths

    def to_host(self, host: torch.Tensor) -> dict[str, list[float]]:
        rows = host.tolist()
        return {rid: row[:n] for rid, row, n in zip(self.request_ids, rows, self.lengths)}


class Pooler:
    def __init__(self) -> None:
        self._partial: dict[str, torch.Tensor] = {}  # MEAN's running sum, CLS's first state

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._partial.pop(rid, None)

    def pool(self, hidden: torch.Tensor, inputs: StepInputs,
             params: list[PoolingParams | None]) -> PooledVectors | None:
        """`params` by row."""
        qsl = inputs.query_start_loc
        ids, vectors, lengths = [], [], []
        for i in inputs.pooling:
            seq, p = inputs.seqs[i], params[inputs.rows[i]]
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            rid = seq.request_id
            if p.pooling_type == "MEAN":
                part = hidden[lo:hi].float().sum(dim=0)
                prev = self._partial.get(rid)
                self._partial[rid] = part if prev is None else prev + part
            elif p.pooling_type == "CLS" and seq.start_pos == 0:
                self._partial[rid] = hidden[lo].float()
            if not seq.sample:
                continue
            if p.pooling_type == "LAST":
                vector = hidden[hi - 1].float()
            elif p.pooling_type == "MEAN":
                vector = self._partial.pop(rid) / (seq.start_pos + hi - lo)
            else:
                vector = self._partial.pop(rid)
            ids.append(rid)
            vectors.append(finish(vector, p))
            lengths.append(len(vectors[-1]))
        if not ids:
            return None
        width = max(lengths)
        out = torch.zeros(len(ids), width, dtype=torch.float32, device=hidden.device)
        for row, v in enumerate(vectors):
            out[row, :len(v)] = v
        return PooledVectors(ids, out, lengths)


def finish(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Truncate, then normalise (OpenAI's order)."""
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    return F.normalize(vector, dim=-1) if params.normalize else vector
