"""Prompt lookup: proposals from the request's own tokens."""

from __future__ import annotations

import numpy as np

from expresslane.runner.proposer import Proposer


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens after the latest earlier match of the longest suffix (max_n..min_n)."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    longest = min(max_n, len(arr) - 1)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # where an earlier n-gram may end
    if not len(ends):
        return []
    length = np.ones(len(ends), dtype=np.int64)  # matched backwards from each end
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, longest):
        at = ends - back
        alive &= at >= 0
        alive[alive] = arr[at[alive]] == arr[-1 - back]
        length += alive
    for n in range(longest, min_n - 1, -1):
        hits = np.flatnonzero(length >= n)
        if len(hits):
            start = int(ends[hits[-1]]) + 1
            return arr[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    """No cache, no device work: the plan carries the proposals."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    @property
    def proposes_on_host(self) -> bool:
        return True

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        return ngram_propose(token_ids, k, self.min_n, self.max_n)

    def catch_up(self, token_ids: list[int], num_computed: int, start: int) -> list[int]:
        return []

    def computed_after(self, num_computed: int, accepted: int, k: int) -> int:
        return 0

    def kv_block_bytes(self, block_size, kv_dtype) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks, block_size, kv_dtype) -> None:
        pass

    def build_graphs(self, max_num_seqs, mixed_tokens, max_blocks, pool, block_size) -> None:
        pass

    def cost_ratio(self, target_params: int) -> float:
        return 0.0

    def step_proposals(self, runner, inputs, spec, ends, k, params, generator):
        drafts = np.full((len(spec), int(k.max())), -1, dtype=np.int64)
        for j, i in enumerate(spec):
            drafts[j, :k[j]] = inputs.seqs[i].token_ids[1:]
        return drafts, None, None
