"""``GET /load``: what a router needs to predict this replica's time to first token.

Plain JSON, cheap to build (read every second by each router):

- ``state``: ready, starting, restarting, draining, ... (a router sends only to ``ready``);
- ``num_running``, ``num_waiting``: the engine's queues after its last step;
- ``waiting_tokens`` / ``waiting_seqs`` per lane: prompt tokens (and sequences) admitted
  but without a first token yet: queued prompts and the rest of running prefills;
- ``step_cost``: the engine's fitted step-cost model (``StepCostModel.to_dict``) and
  ``max_num_batched_tokens``, its step budget; ``prefill_rate``: tokens/s its recent steps
  processed (a fallback when there is no model);
- ``scheduling_policy``, ``pd_lanes``: the engine's (a tool such as `bench doctor` advises flags by them).
"""

from __future__ import annotations

from expresslane.server.engine_client import EngineClient
from expresslane.server.metrics import Metrics


def load_snapshot(client: EngineClient, metrics: Metrics) -> dict:
    stats = metrics.last_engine_stats
    adm = client.admission
    return {
        "state": client.state,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_cache_usage": stats.kv_cache_usage,
        "waiting_tokens": dict(adm.waiting_tokens_by_lane),
        "waiting_seqs": dict(adm.waiting_seqs_by_lane),
        "num_inflight": client.num_inflight,
        "prefill_rate": adm.prefill_rate,
        "step_cost": getattr(client, "step_cost", None) or None,
        "max_num_batched_tokens": getattr(client, "max_num_batched_tokens", 0),
        "scheduling_policy": getattr(client, "scheduling_policy", None),
        "pd_lanes": getattr(client, "pd_lanes", None),
    }
