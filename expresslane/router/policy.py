"""Where a request goes (pure: no I/O, no clock). The router keeps one ``Replica`` per backend,
refreshed from its ``GET /load`` (server/load.py), and asks ``choose``:

- interactive: the replica with the smallest predicted time to first token *for this
  request*: the prompt tokens ahead of it there plus its own, minus what that replica
  already holds of its prefix, through that replica's step-cost model;
- prefix affinity falls out of that: a replica that served the conversation's earlier
  turns needs to prefill only the new part, so it wins unless it is busier by more;
- batch: the least-loaded replica (waiting tokens, then running sequences);
- only healthy replicas in state ``ready`` are candidates (draining ones finish what
  they have, dead ones are out).

Prompts are counted without a tokenizer: ``CHARS_PER_TOKEN`` characters per token (token
id prompts exactly). Prefixes are chained hashes of ``CHUNK_CHARS``-character chunks,
like the engine's KV block hashes; each replica remembers the last ``PREFIX_CAPACITY``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.cost_model.piecewise import PiecewiseStepCostModel

CHARS_PER_TOKEN = 4
CHUNK_CHARS = 64
PREFIX_CAPACITY = 50_000
TIE_RELATIVE, TIE_ABSOLUTE = 1.25, 0.005  # TTFT predictions within 25% + 5 ms of the best count as a tie
BATCH_SHARE = 0.25  # the batch lane's default budget share (lanes.py): its tokens slow interactive ones this much


@dataclass(slots=True)
class Load:
    """A replica's ``/load`` answer."""

    state: str = "unknown"
    num_running: int = 0
    num_waiting: int = 0
    waiting_tokens: dict[str, int] = field(default_factory=dict)
    prefill_rate: float | None = None
    step_cost: StepCostModel | None = None
    budget: int = 0  # max_num_batched_tokens

    @classmethod
    def from_json(cls, d: dict) -> "Load":
        cost = d.get("step_cost")
        return cls(state=str(d.get("state", "unknown")), num_running=int(d.get("num_running", 0)),
                   num_waiting=int(d.get("num_waiting", 0)),
                   waiting_tokens={str(k): int(v) for k, v in (d.get("waiting_tokens") or {}).items()},
                   prefill_rate=d.get("prefill_rate"),
                   step_cost=PiecewiseStepCostModel.from_dict(cost) if cost else None,
                   budget=int(d.get("max_num_batched_tokens") or 0))


@dataclass(slots=True)
class Replica:
    url: str
    healthy: bool = False
    load: Load = field(default_factory=Load)
    # prompt tokens this router sent that have no first token yet, per lane: the replica's
    # /load is up to one poll old, this is not (the larger of the two counts)
    pending: dict[str, int] = field(default_factory=dict)
    prefixes: OrderedDict = field(default_factory=OrderedDict)
    routed: int = 0  # requests sent here: among equally good replicas, the one with fewer gets the next

    @property
    def available(self) -> bool:
        return self.healthy and self.load.state == "ready"

    def waiting(self, lane: str) -> int:
        return max(self.load.waiting_tokens.get(lane, 0), self.pending.get(lane, 0))

    def matched_chars(self, keys: list[int]) -> int:
        """Characters of the prompt's prefix this replica has seen (whole chunks)."""
        n = 0
        for key in keys:
            if key not in self.prefixes:
                break
            n += 1
        return n * CHUNK_CHARS

    def remember(self, keys: list[int]) -> None:
        for key in keys:
            self.prefixes[key] = None
            self.prefixes.move_to_end(key)
        while len(self.prefixes) > PREFIX_CAPACITY:
            self.prefixes.popitem(last=False)

    def forget_prefixes(self) -> None:
        """A restarted or dead replica's KV cache is gone."""
        self.prefixes.clear()


def prefix_keys(text: str) -> list[int]:
    """Chained hashes of the prompt's whole CHUNK_CHARS-character chunks."""
    keys, h = [], 0
    for i in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        h = hash((h, text[i:i + CHUNK_CHARS]))
        keys.append(h)
    return keys


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def predict_ttft(replica: Replica, num_tokens: int, cached_tokens: int = 0) -> float:
    """Seconds until this request's first token on `replica`: the interactive work ahead of
    it (batch work at its budget share), then its own uncached tokens, in steps of the
    replica's budget beside its running decodes, each timed by the replica's cost model.
    Without a model: at its recent prefill rate; without that either: queue depth."""
    load = replica.load
    work = (replica.waiting("interactive") + BATCH_SHARE * replica.waiting("batch")
            + max(1, num_tokens - cached_tokens))
    decodes = load.num_running
    if load.step_cost is not None and load.budget > 0:
        chunk = max(1, load.budget - decodes)
        steps = math.ceil(work / chunk)
        n = int(min(chunk, work))
        step = load.step_cost.predict(StepShape(n + decodes, 0, n * (n + 1) // 2, True))
        return steps * step
    if load.prefill_rate:
        return work / load.prefill_rate
    return float(load.num_waiting + 1) + work * 1e-6


def choose(replicas: list[Replica], lane: str, text: str, num_tokens: int | None = None) -> Replica | None:
    """The replica for a request (None: none available). `text` is what the prefix hashes
    cover; `num_tokens` its prompt tokens when known exactly."""
    live = [r for r in replicas if r.available]
    if not live:
        return None
    tokens = num_tokens if num_tokens is not None else estimate_tokens(text)
    keys = prefix_keys(text)
    if lane == "batch":
        def rank(i_r):
            i, r = i_r
            queued = sum(r.waiting(ln) for ln in ("interactive", "batch"))
            return (queued, r.load.num_running + r.load.num_waiting, -r.matched_chars(keys), r.routed, i)
        _, best = min(enumerate(live), key=rank)
    else:
        cached = [r.matched_chars(keys) // CHARS_PER_TOKEN for r in live]
        ttft = [predict_ttft(r, tokens, c) for r, c in zip(live, cached)]
        # predictions are rough (fitted, one poll old): near the best is as good as the best;
        # among those, the longest cached prefix, then the fewest tokens pending, the fewest sent
        near = TIE_RELATIVE * min(ttft) + TIE_ABSOLUTE
        ties = [i for i, t in enumerate(ttft) if t <= near]
        best = live[min(ties, key=lambda i: (-cached[i], sum(live[i].pending.values()), live[i].routed, i))]
    best.remember(keys)
    best.routed += 1
    return best
