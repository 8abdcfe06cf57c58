"""The runner's per-request rows and a step's host inputs, gathered in O(step tokens + new
blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from expresslane.contract import NewRequest, ScheduledSeq, StepPlan
from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams


@dataclass(slots=True)
class StepInputs:
    """Flattened, decodes first."""

    seqs: list[ScheduledSeq]  # in the step's order
    rows: np.ndarray  # [B] the seqs' rows
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    rope_lengths: np.ndarray  # [T] int64, each token's request's NewRequest.rope_length (RoPE by length)
    slot_mapping: np.ndarray  # [G, T] int64: G KV groups
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32, context after the step
    block_tables: np.ndarray  # [G, B, width] int32, padded with 0
    num_decodes: int
    sampling: np.ndarray  # seqs that sample
    from_previous: np.ndarray  # seqs whose input token is on the device
    num_spec: np.ndarray  # [B] proposals: each seq's last tokens
    pooling: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # pooling requests' seqs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class RequestRows:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, kv_groups: int = 1):
        self.block_size = block_size
        self.block_table = np.zeros((kv_groups, max_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}  # request id -> row
        self.rope_lengths = np.zeros(max_rows, dtype=np.int64)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.params: list[SamplingParams | None] = [None] * max_rows
        self.banned: list[tuple[int, ...]] = [()] * max_rows
        self.num_banned_samples = [0] * max_rows
        self.lora_ids = np.zeros(max_rows, dtype=np.int64)
        self.pooling: list[PoolingParams | None] = [None] * max_rows

    def apply(self, plan: StepPlan) -> StepInputs:
        """Forget, take in, then gather the step's inputs."""
        for rid in plan.finished_request_ids:
            self._remove(rid)
        for rid in plan.preempted_request_ids:
            self._remove(rid)
        for new in plan.new_requests:
            self._add(new)
        # decodes first: the backends batch them
        seqs = sorted(plan.seqs, key=lambda s: len(s.token_ids) != 1)
        return self.gather(seqs)

    def _add(self, new: NewRequest) -> None:
        if new.request_id in self.row_of:
            raise RuntimeError(f"request {new.request_id!r} is already in the runner")
        row = self.row_of[new.request_id] = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.rope_lengths[row] = new.rope_length or new.num_prompt_tokens
        self.params[row] = new.sampling_params
        self.banned[row] = new.banned_token_ids
        self.num_banned_samples[row] = new.num_banned_samples
        self.lora_ids[row] = new.lora_id
        self.pooling[row] = new.pooling

    def _remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.params[row] = None
            self.pooling[row] = None
            self._free_rows.append(row)

    def gather(self, seqs: list[ScheduledSeq]) -> StepInputs:
        """The step inputs of requests already in the rows (the draft model gathers its own steps)."""
        num = len(seqs)
        rows = np.empty(num, dtype=np.int64)
        counts = np.empty(num, dtype=np.int64)
        starts = np.empty(num, dtype=np.int64)
        token_ids: list[int] = []
        sampling, from_previous, pooling = [], [], []
        num_spec = np.zeros(num, dtype=np.int64)
        num_decodes = 0
        for i, s in enumerate(seqs):
            row = rows[i] = self.row_of[s.request_id]
            n = counts[i] = len(s.token_ids)
            starts[i] = s.start_pos
            token_ids += s.token_ids
            num_decodes += n == 1
            if s.new_block_ids:
                have, groups = self.num_blocks[row], len(self.block_table)
                new = len(s.new_block_ids) // groups
                self.block_table[:, row, have:have + new] = np.reshape(s.new_block_ids, (groups, new))
                self.num_blocks[row] = have + new
            if self.pooling[row] is not None:
                pooling.append(i)
            elif s.sample:
                sampling.append(i)
            if s.from_previous:
                from_previous.append(i)
            num_spec[i] = s.num_spec_tokens
        qsl = np.zeros(num + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        seq_of_token = np.repeat(np.arange(num), counts)
        positions = np.arange(qsl[-1], dtype=np.int64) + np.repeat(starts - qsl[:-1], counts)
        bs = self.block_size
        slots = self.block_table[:, rows[seq_of_token], positions // bs].astype(np.int64) * bs + positions % bs
        width = int(self.num_blocks[rows].max()) if num else 0
        return StepInputs(
            seqs=seqs, rows=rows, token_ids=np.array(token_ids, dtype=np.int64), positions=positions,
            rope_lengths=self.rope_lengths[rows[seq_of_token]],
            slot_mapping=slots, query_start_loc=qsl, seq_lens=(starts + counts).astype(np.int32),
            block_tables=self.block_table[:, rows, :width], num_decodes=num_decodes,
            sampling=np.array(sampling, dtype=np.int64), pooling=np.array(pooling, dtype=np.int64),
            from_previous=np.array(from_previous, dtype=np.int64),
            num_spec=num_spec)

    def token_lora_ids(self, inputs: StepInputs) -> np.ndarray:
        """[T] each token's adapter id."""
        return np.repeat(self.lora_ids[inputs.rows], np.diff(inputs.query_start_loc))

    def sampling_rows(self, inputs: StepInputs) -> tuple[list[SamplingParams], list[tuple[int, ...]]]:
        """Sampling seqs' parameters and banned tokens; counts down `min_tokens`."""
        params, banned = [], []
        for i in inputs.sampling:
            row = inputs.rows[i]
            params.append(self.params[row])
            if self.num_banned_samples[row] > 0:
                self.num_banned_samples[row] -= 1
                banned.append(self.banned[row])
            else:
                banned.append(())
        return params, banned
