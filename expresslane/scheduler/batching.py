"""Static and dynamic batching (flat-latency baselines): a batch starts when none runs, prefills
in one step, decodes until all finish; ``dynamic`` waits up to ``batch_timeout_ms`` to fill."""

from __future__ import annotations

import time

from expresslane.config import SchedulerConfig
from expresslane.cost_model.base import StepCostModel
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.policy import StepBudget
from expresslane.scheduler.request import Request
from expresslane.scheduler.scheduler import Scheduler
from expresslane.scheduler.spec_decode import SpecDecoder


class FixedBatchScheduler(Scheduler):
    def _schedule(self, lane: str | None = None) -> list[tuple[Request, int]]:
        if self.running:
            scheduled, _ = self._schedule_running(StepBudget.unlimited(), self.speculating())
            return scheduled
        if not self._batch_ready():
            return []
        scheduled: list[tuple[Request, int]] = []
        self._admit(scheduled, StepBudget.unlimited(), min(self.config.max_batch_size, self.config.max_num_seqs))
        return scheduled

    def _make_room(self, req: Request, scheduled: list[tuple[Request, int]], budget: StepBudget) -> bool:
        return False  # a batch is fixed

    def _batch_ready(self) -> bool:
        head = self._peek_waiting()
        if head is None:
            return False
        if self.config.batching == "static" or self.num_waiting >= self.config.max_batch_size:
            return True
        return self.clock() - head.arrival_time >= self.config.batch_timeout_ms / 1000


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager, clock=time.monotonic,
                   cost_model: StepCostModel | None = None, spec: SpecDecoder | None = None,
                   max_loras: int = 0, rope_restart_at: int = 0) -> Scheduler:
    cls = Scheduler if config.batching == "continuous" else FixedBatchScheduler
    return cls(config, kv, clock, cost_model, spec, max_loras, rope_restart_at)
