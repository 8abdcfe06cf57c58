"""Prometheus metrics with vLLM's names under the ``expresslane:`` prefix (DESIGN §5).

Engine-wide gauges and counters come from the engine's per-step ``StepStats``;
request histograms are observed in the API process from the engine's monotonic
timestamps and carry a ``lane`` label. One registry per server (no global state).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from expresslane.engine.core import StepStats
from expresslane.outputs import RequestOutput

LANES = ("interactive", "batch")
FINISH_REASONS = ("stop", "length", "abort")
# From 1 ms: CPU-side overheads and small-model steps live in the first buckets.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.6, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        req = ("model_name", "lane")
        eng = ("model_name",)

        def hist(name: str, doc: str, buckets: tuple, labels: tuple = req) -> Histogram:
            return Histogram(f"expresslane:{name}", doc, labels, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between successive output steps of a request.",
                        LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        self.iteration_tokens = hist("iteration_tokens", "Tokens computed per engine step.", COUNT_BUCKETS, eng)
        self.batch_size = hist("batch_size", "Requests per engine step.", COUNT_BUCKETS, eng)
        self.step_duration = hist("step_duration_seconds", "Wall time of one engine step.", LATENCY_BUCKETS, eng)
        self.running = Gauge("expresslane:num_requests_running", "Requests in the running batch.", eng, registry=r)
        self.waiting = Gauge("expresslane:num_requests_waiting", "Requests waiting to be scheduled.", eng,
                             registry=r)
        self.kv_usage = Gauge("expresslane:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", eng,
                              registry=r)
        self.prefix_queries = Counter("expresslane:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", eng, registry=r)
        self.prefix_hits = Counter("expresslane:prefix_cache_hits", "Prompt tokens found in the prefix cache.", eng,
                                   registry=r)
        self.preemptions = Counter("expresslane:num_preemptions", "Requests preempted (recomputed later).", eng,
                                   registry=r)
        self.prompt_tokens = Counter("expresslane:prompt_tokens", "Prompt tokens of requests that started.", req,
                                     registry=r)
        self.generation_tokens = Counter("expresslane:generation_tokens", "Tokens generated.", req, registry=r)
        self.success = Counter("expresslane:request_success", "Finished completions by finish reason.",
                               ("model_name", "lane", "finished_reason"), registry=r)
        self._engine_totals = StepStats(0, 0, 0.0)
        for lane in LANES:  # every series exists from the start, at 0
            for reason in FINISH_REASONS:
                self.success.labels(model_name, lane, reason)
            self.prompt_tokens.labels(model_name, lane)
            self.generation_tokens.labels(model_name, lane)
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(model_name).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def engine_step(self, s: StepStats) -> None:
        m = self.model_name
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_cache_usage)
        last = self._engine_totals
        self.prefix_queries.labels(m).inc(max(0, s.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.labels(m).inc(max(0, s.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.labels(m).inc(max(0, s.num_preemptions - last.num_preemptions))
        self._engine_totals = s
        if s.batch_size:  # turns that only handled messages ran no model
            self.iteration_tokens.labels(m).observe(s.num_batched_tokens)
            self.batch_size.labels(m).observe(s.batch_size)
            self.step_duration.labels(m).observe(s.step_duration)

    def engine_stopped(self) -> None:
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(self.model_name).set(0)

    def new_tokens(self, lane: str, n: int, gap: float | None) -> None:
        self.generation_tokens.labels(self.model_name, lane).inc(n)
        if gap is not None:
            self.itl.labels(self.model_name, lane).observe(gap)

    def first_token(self, lane: str, out: RequestOutput) -> None:
        m = out.metrics
        labels = (self.model_name, lane)
        self.prompt_tokens.labels(*labels).inc(len(out.prompt_token_ids))
        self.ttft.labels(*labels).observe(m.first_token_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(*labels).observe(m.first_scheduled_time - m.arrival_time)
            self.prefill.labels(*labels).observe(m.first_token_time - m.first_scheduled_time)

    def finished(self, lane: str, out: RequestOutput) -> None:
        """A request whose completions all finished; aborted ones count only in request_success."""
        for comp in out.outputs:
            self.success.labels(self.model_name, lane, comp.finish_reason).inc()
        m = out.metrics
        if m.finished_time is None or any(c.finish_reason == "abort" for c in out.outputs):
            return
        self.e2e.labels(self.model_name, lane).observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.decode.labels(self.model_name, lane).observe(m.finished_time - m.first_token_time)
