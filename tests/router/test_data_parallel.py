"""`expresslane serve --data-parallel-size 2`: two engines behind one address (the router in
front of two replicas it starts); greedy output equals the offline engine's, and both
replicas get work."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI
from server.conftest import API_KEY, Server, llm  # noqa: F401  (`llm`: the offline reference)

from expresslane import SamplingParams
from expresslane.router.data_parallel import replica_argv


def test_replica_argv_drops_the_front_flags():
    argv = ["--log-level", "INFO", "serve", "m", "--port", "9", "--data-parallel-size=2", "--host", "0.0.0.0",
            "--max-num-seqs", "4"]
    assert replica_argv(argv) == ["--log-level", "INFO", "serve", "m", "--max-num-seqs", "4"]


def test_data_parallel_serve(llm):  # noqa: F811
    server = Server("--data-parallel-size", "2")
    try:
        server.wait_ready(timeout=240)
        # the router is up once one replica is: wait until both are, or every request goes to the first
        deadline = time.monotonic() + 240  # a hang guard, not a figure
        while "down" in httpx.get(server.url + "/health").json()["replicas"].values():
            assert time.monotonic() < deadline, "a replica never came up"
            time.sleep(0.2)
        client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        prompts = [f"request number {i} " * 10 for i in range(12)]

        # The batch lane: it goes to the least-loaded replica by the router's own count of what it
        # sent, so the work spreads whatever the replicas' timings. (Interactive requests follow
        # each replica's step-cost model, calibrated on its own start-up: on a loaded CI machine
        # one replica can measure itself far slower and rightly get every request. That choice
        # is tested in tests/router/test_policy.py on given loads.)
        def one(p):
            return client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0.0,
                                             extra_body={"lane": "batch"}).choices[0].text

        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(one, prompts))
        ref = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
        assert texts == [o.outputs[0].text for o in ref]
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        sent = [float(ln.rsplit(" ", 1)[1]) for ln in lines
                if ln.startswith("expresslane:router_requests_total{") and 'lane="batch"' in ln]
        assert len(sent) == 2 and all(n > 0 for n in sent), sent
    finally:
        server.stop()
