"""CUDA graphs for decode steps: one graph per bucketed batch size.

A decode step (every seq computes exactly one token) is replayed from the smallest
captured bucket that holds it. Inputs live in static buffers; padding rows carry
slot -1 (no KV write) and seq_len 0 (nothing to attend to), so they compute garbage
that nobody reads. Only the attention backend's decode path runs inside a graph, and
its launch grid depends on the bucket size alone.
"""

from __future__ import annotations

import logging
import time

import torch

from expresslane.attention.backend import AttentionMetadata

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model, backend, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.sizes = bucket_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
            query_start_loc=self.query_start_loc[:b + 1], num_decodes=b, seq_lens_cpu=[0] * b,
            query_start_loc_cpu=list(range(b + 1)), max_decode_seq_len=0)
        self.backend.prepare(meta)
        return meta

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._meta(b))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: later graphs reuse its memory
            self._forward(b)  # warm-up: compile kernels, settle the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.sizes), self.sizes[0],
                 self.sizes[-1], time.monotonic() - t0)

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Replay the smallest graph that fits; returns logits [len(token_ids), vocab]."""
        n = len(token_ids)
        b = next(s for s in self.sizes if s >= n)
        width = max(len(t) for t in block_tables)
        host = torch.tensor([token_ids, positions, slots], dtype=torch.int64)
        self.input_ids[:n].copy_(host[0], non_blocking=True)
        self.positions[:n].copy_(host[1], non_blocking=True)
        self.slot_mapping[:n].copy_(host[2], non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[n:b].fill_(0)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        self.block_tables[:n, :width].copy_(table, non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n]
