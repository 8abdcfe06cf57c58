"""The router's Prometheus metrics: per replica (up, its load, what was routed there) and
for the router itself (retries, failures, time to first byte)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from expresslane.router.policy import Replica

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
LANES = ("interactive", "batch")


class RouterMetrics:
    def __init__(self, replicas: list[str]):
        self.registry = r = CollectorRegistry()
        p = "expresslane:router_"
        self.up = Gauge(f"{p}replica_up", "1 while the replica is healthy and ready.", ("replica",), registry=r)
        self.waiting = Gauge(f"{p}replica_waiting_tokens", "Prompt tokens waiting for a first token at the "
                             "replica (its /load, or what this router sent since, the larger).",
                             ("replica", "lane"), registry=r)
        self.running = Gauge(f"{p}replica_num_requests_running", "Requests running at the replica (its /load).",
                             ("replica",), registry=r)
        self.requests = Counter(f"{p}requests_total", "Requests sent to each replica (retries included).",
                                ("replica", "lane"), registry=r)
        self.retries = Counter(f"{p}retries_total", "Requests taken from a replica that failed before any "
                               "token and sent to another.", ("replica",), registry=r)
        self.failures = Counter(f"{p}request_failures_total", "Requests the router could not serve.", ("reason",),
                                registry=r)
        self.predicted = Histogram(f"{p}predicted_ttft_seconds", "The predicted TTFT at the chosen replica.",
                                   ("replica",), buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram(f"{p}time_to_first_byte_seconds", "Arrival at the router to the replica's first "
                              "response byte.", ("replica", "lane"), buckets=LATENCY_BUCKETS, registry=r)
        for url in replicas:
            self.up.labels(url).set(0)
            self.running.labels(url).set(0)
            for lane in LANES:
                self.waiting.labels(url, lane).set(0)
                self.requests.labels(url, lane)
            self.retries.labels(url)
        for reason in ("no_replica_available", "no_replica_accepted", "replica_lost_mid_stream"):
            self.failures.labels(reason)

    def replica_load(self, replica: Replica) -> None:
        self.up.labels(replica.url).set(1 if replica.available else 0)
        self.running.labels(replica.url).set(replica.load.num_running if replica.healthy else 0)
        for lane in LANES:
            self.waiting.labels(replica.url, lane).set(replica.waiting(lane) if replica.healthy else 0)

    def routed(self, url: str, lane: str, predicted_ttft: float) -> None:
        self.requests.labels(url, lane).inc()
        self.predicted.labels(url).observe(predicted_ttft)

    def retried(self, url: str) -> None:
        self.retries.labels(url).inc()

    def failed(self, reason: str) -> None:
        self.failures.labels(reason).inc()

    def first_byte(self, url: str, lane: str, seconds: float) -> None:
        self.ttfb.labels(url, lane).observe(seconds)
