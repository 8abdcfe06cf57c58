"""CUDA graphs over static buffers: decode graphs by batch size, mixed graphs by token count."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.device import stage
from expresslane.layers.lora import LoRAStep
from expresslane.runner.request_rows import StepInputs

log = logging.getLogger(__name__)


def bucket_sizes(limit: int, small: tuple[int, ...] = (1, 2, 4, 8), step: int = 16) -> list[int]:
    sizes = [b for b in small if b <= limit] + list(range(step, limit + 1, step))
    if not sizes or sizes[-1] != limit:
        sizes.append(limit)
    return sorted(set(sizes))


def piece_bounds(num_layers: int, pieces: int) -> list[int]:
    """Layer-range bounds sized 1 : 3 : 5 : ..."""
    total = pieces * pieces
    return [num_layers * i * i // total for i in range(pieces + 1)]


class _Graphs:
    """A bucket is `num_pieces` graphs of growing layer ranges."""

    num_pieces = 1

    def __init__(self, model, backend, sizes: list[int], max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device, logits_out: torch.Tensor, kv_groups: int = 1):
        self.model, self.backend, self.sizes = model, backend, sizes
        self.logits_out = logits_out  # shared by every graph
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.rope_lengths = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((kv_groups, max_tokens), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(kv_groups, max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        lora = model.lora_state
        self.lora = None if lora is None else LoRAStep.static(max_tokens, lora.num_slots, device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # a graph runs where it was captured, whatever stream replays it: SMs -> size -> pieces
        self.placed: dict[int, dict[int, list[torch.cuda.CUDAGraph]]] = {0: self.graphs}
        self.placement = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def _num_logit_rows(self, size: int) -> int:
        raise NotImplementedError

    def _pieces(self, size: int) -> list:
        """`num_pieces` callables; the last returns the logits."""
        model, meta, carry = self.model, self._meta(size), {}
        n = len(model.layers)
        bounds = piece_bounds(n, self.num_pieces)
        positions = self.positions[:size]

        def piece(i: int):
            def run():
                if self.lora is not None:
                    model.lora_state.step = self.lora
                x, res = (model.embed_tokens(self.input_ids[:size]), None) if i == 0 else carry["hidden"]
                x, res = model.run_layers(positions, x, res, meta, bounds[i], bounds[i + 1])
                if i + 1 < self.num_pieces:
                    carry["hidden"] = x, res
                    return None
                rows = self._num_logit_rows(size)
                hidden = model.final_norm(x, res)
                return model.compute_logits(hidden[self.logits_rows[:rows]], out=self.logits_out[:rows])
            return run
        return [piece(i) for i in range(self.num_pieces)]

    def _forward(self, size: int) -> torch.Tensor:
        for run in self._pieces(size):
            out = run()
        return out

    @torch.inference_mode()
    def capture(self, pool, stream: torch.cuda.Stream | None = None, placement: int = 0) -> None:
        t0 = time.monotonic()
        graphs = self.placed.setdefault(placement, {})
        for size in reversed(self.sizes):  # largest first: later graphs reuse its memory
            pieces = self._pieces(size)
            if not placement:
                for run in pieces:  # warm-up: compile kernels, settle the allocator
                    run()
            torch.cuda.synchronize()
            graphs[size] = []
            for run in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    run()
                graphs[size].append(graph)
        torch.cuda.synchronize()
        log.info("captured %d %s (sizes %d..%d, %d piece(s) each%s) in %.1fs", len(self.sizes), type(self).__name__,
                 self.sizes[0], self.sizes[-1], self.num_pieces, f", on {placement} SMs" if placement else "",
                 time.monotonic() - t0)

    def _load(self, fields: list[tuple[torch.Tensor, np.ndarray, int]], patch: Patch | None) -> None:
        """`fields`: (buffer view, values, pad fill); one host->device copy."""
        parts = [(values, buffer.numel(), fill) for buffer, values, fill in fields]
        staged = stage(parts + (list(patch.indices) if patch else []), self.device)
        for (buffer, _, _), values in zip(fields, staged):
            buffer.copy_(values if buffer.dim() == 1 else values.view(buffer.shape))
        if patch is not None:
            patch.apply(self.input_ids, *staged[len(fields):])

    def _token_fields(self, inputs: StepInputs, padded: int, num_seqs: int) -> list:
        """Padded to `padded` tokens and `num_seqs` seqs."""
        t, (groups, b, width) = inputs.num_tokens, inputs.block_tables.shape
        slots = np.full((groups, padded), -1, dtype=np.int64)
        slots[:, :t] = inputs.slot_mapping
        fields = [(self.input_ids[:t], inputs.token_ids, 0), (self.positions[:padded], inputs.positions, 0),
                  (self.rope_lengths[:padded], inputs.rope_lengths, 0), (self.seq_lens[:num_seqs], inputs.seq_lens, 0),
                  (self.slot_mapping[:, :padded], slots, -1), (self.block_tables[:, :b, :width], inputs.block_tables, 0)]
        if self.lora is not None:
            fields += self.lora.fields(self.model.lora_state.step, padded)
        return fields

    def _replay(self, size: int, rows: int) -> torch.Tensor:
        graphs = self.placed[self.placement]
        if size in graphs:
            for graph in graphs[size]:
                graph.replay()
            return self.logits_out[:rows]
        return self._forward(size)[:rows]  # not captured (CPU tests): eager


class DecodeGraphs(_Graphs):
    """Every seq computes one token."""

    def __init__(self, model, backend, max_num_seqs: int, max_blocks: int, device: torch.device,
                 logits_out: torch.Tensor, kv_groups: int = 1):
        sizes = bucket_sizes(max_num_seqs)
        super().__init__(model, backend, sizes, sizes[-1], sizes[-1] + 1, max_blocks, device, logits_out, kv_groups)
        self.logits_rows[:] = torch.arange(sizes[-1] + 1, device=device)

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[0, :size], block_tables=self.block_tables[0, :size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1], num_decodes=size,
            seq_lens_cpu=[0] * size, query_start_loc_cpu=list(range(size + 1)), max_decode_seq_len=0,
            rope_lengths=self.rope_lengths[:size])
        self.backend.prepare(meta)  # split count depends on batch size only
        return meta.with_groups(self.slot_mapping[:, :size], self.block_tables[:, :size])

    def _num_logit_rows(self, size: int) -> int:
        return size

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens == num_seqs and num_seqs <= self.max_size

    def run(self, inputs: StepInputs, patch: Patch | None) -> torch.Tensor:
        n = inputs.num_tokens
        size = next(s for s in self.sizes if s >= n)
        # padding seqs: no context, one token each
        self._load(self._token_fields(inputs, size, size), patch)
        return self._replay(size, n)


class DraftChainGraphs(DecodeGraphs):
    """Greedy draft proposals 2..k in one replay; a seq writes KV only while `counts` > forward
    + 1."""

    def __init__(self, model, backend, max_num_seqs: int, max_blocks: int, device: torch.device,
                 logits_out: torch.Tensor, steps: int, block_size: int):
        super().__init__(model, backend, max_num_seqs, max_blocks, device, logits_out)
        self.steps, self.block_size = steps, block_size
        self.counts = torch.zeros(self.max_size, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(self.max_size, steps, dtype=torch.int64, device=device)

    def _pieces(self, size: int) -> list:
        [forward] = super()._pieces(size)
        ids, pos, lens, slots = (self.input_ids[:size], self.positions[:size], self.seq_lens[:size],
                                 self.slot_mapping[0, :size])
        table, counts, bs = self.block_tables[0, :size], self.counts[:size], self.block_size

        def run():
            for j in range(self.steps):
                live = counts > j + 1  # it proposes past j + 1
                if j:  # live seqs advance; the others keep their last slot
                    ids.copy_(self.tokens[:size, j - 1])
                    pos.add_(live)
                    lens.add_(live)
                block = table.gather(1, torch.div(pos, bs, rounding_mode="floor")[:, None]).squeeze(1)
                slots.copy_(torch.where(live, block.to(torch.int64) * bs + pos % bs, -1))
                self.tokens[:size, j].copy_(forward().argmax(dim=-1))
            return self.tokens[:size]
        return [run]

    def run_chain(self, inputs: StepInputs, patch: Patch, counts: np.ndarray) -> torch.Tensor:
        """Proposals 2..steps + 1, [num_seqs, steps] on the device."""
        n = inputs.num_tokens
        size = next(s for s in self.sizes if s >= n)
        self._load(self._token_fields(inputs, size, size) + [(self.counts[:size], counts, 0)], patch)
        self._replay(size, n)  # fills `tokens`
        return self.tokens[:n]


class MixedGraphs(_Graphs):
    """Any composition up to `max_tokens` tokens (prefill path)."""

    num_pieces = 4

    def __init__(self, model, backend, max_tokens: int, max_num_seqs: int, max_blocks: int, device: torch.device,
                 logits_out: torch.Tensor, kv_groups: int = 1):
        # SLO-sized steps: dense to 512
        sizes = bucket_sizes(max_tokens, small=(8, 16, 32, 64, 192, 320, 448), step=128)
        self.max_seqs = min(sizes[-1], max_num_seqs)
        super().__init__(model, backend, sizes, sizes[-1], self.max_seqs + 1, max_blocks, device, logits_out,
                         kv_groups)
        self.work = torch.zeros(max(backend.max_prefill_work(s, self._seqs(s)) for s in sizes), 5, dtype=torch.int32,
                                device=device)
        self.work[:, 3] = 1  # valid items for the capture's warm-up

    def _seqs(self, size: int) -> int:
        return min(size, self.max_seqs)

    def _meta(self, size: int) -> AttentionMetadata:
        b = self._seqs(size)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[0, :size], block_tables=self.block_tables[0, :b + 1],
            seq_lens=self.seq_lens[:b + 1], query_start_loc=self.query_start_loc[:b + 2], num_decodes=0,
            seq_lens_cpu=[], query_start_loc_cpu=[], max_decode_seq_len=0, num_splits=1,
            prefill_tile=self.backend.prefill_tile(size),
            prefill_work=self.work[:self.backend.max_prefill_work(size, b)], rope_lengths=self.rope_lengths[:size],
        ).with_groups(self.slot_mapping[:, :size], self.block_tables[:, :b + 1])

    def _num_logit_rows(self, size: int) -> int:
        return self._seqs(size)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_size and num_seqs <= self._seqs(num_tokens)

    def fits_rows(self, num_tokens: int, num_seqs: int, num_rows: int) -> bool:
        """A verify step: logits at `num_rows` chosen tokens."""
        return self.fits(num_tokens, num_seqs) and num_rows <= self.max_seqs

    def run(self, inputs: StepInputs, patch: Patch | None, rows: np.ndarray | None = None) -> torch.Tensor:
        """Logits at each seq's last token, or at token indices `rows`."""
        t, b = inputs.num_tokens, len(inputs.seq_lens)
        size = next(s for s in self.sizes if s >= t and self._seqs(s) >= b)
        seqs = self._seqs(size)
        qsl = inputs.query_start_loc
        capacity = self.backend.max_prefill_work(size, seqs)
        work = np.empty((capacity, 5), dtype=np.int64)
        planned = self.backend.plan_prefill(qsl, inputs.seq_lens, 0, self.backend.prefill_tile(size))
        work[:len(planned)] = planned
        work[len(planned):] = (-1, 0, 0, 1, 0)  # padding: its programs return at once
        fields = self._token_fields(inputs, size, b + 1)  # the padding seq's context: 0
        wanted = qsl[1:] - 1 if rows is None else rows
        fields += [(self.query_start_loc[:b + 2], qsl, t), (self.logits_rows[:seqs], wanted, 0),
                   (self.work[:capacity], work, 0)]
        self._load(fields, patch)
        return self._replay(size, len(wanted))


class Patch:
    """`input_ids[dst] = previous[src]`: tokens the previous step sampled, on the device."""

    def __init__(self, dst: np.ndarray, src: np.ndarray, previous: torch.Tensor):
        self.indices, self.previous = (dst, src), previous

    def apply(self, input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        input_ids.index_copy_(0, dst, self.previous[src])
