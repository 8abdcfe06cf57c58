"""A batch survives kill -9 of its server: every request answered exactly once (SQLite and Redis).

The server (and its engine) is killed with SIGKILL twice while the batch drains and
started again on the same store; the leases of what the dead server held run out and
the new server takes them over. ``EXPRESSLANE_BATCH_TEST_N`` sets the batch size
(64 by default, to keep CI short; docs/batch.md records the 1,000-request run).
"""

from __future__ import annotations

import io
import json
import os
import signal

import pytest
from openai import OpenAI

from .conftest import API_KEY, Server, metric
from .test_batch_api import requests_file, wait_batch

N = int(os.environ.get("EXPRESSLANE_BATCH_TEST_N", "64"))
# Four requests at a time, 8 tokens each: the kills wait for a count of completed requests,
# and the test asserts that the batch was still in progress at each, so speed cannot hide a race.
TOKENS = 8


def start(store_url: str) -> tuple[Server, OpenAI]:
    s = Server("--batch-store", store_url, "--batch-lease-seconds", "2", "--batch-concurrency", "4",
               "--scheduling-policy", "deadline").wait_ready()
    return s, OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_kill9_twice_mid_batch_answers_every_request_once(kind, tmp_path, request):
    url = (f"sqlite:{tmp_path / 'store.db'}" if kind == "sqlite"
           else request.getfixturevalue("redis_server").store_url())
    server, client = start(url)
    try:
        content = requests_file(N, max_tokens=TOKENS)
        f = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
        batch_id = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id
        for k in (1, 2):
            # kill at a quarter and at half way: at least half the batch is left to race the kill
            seen = wait_batch(client, batch_id, until=lambda b: b.request_counts.completed >= k * N // 4, poll=0.02)
            assert seen.status == "in_progress", f"the batch finished before kill {k}: {seen.request_counts}"
            m = server.metrics()  # progress in /metrics too (refreshed every poll of the worker)
            assert 0 < metric(m, "expresslane:batch_requests_pending") <= N
            assert metric(m, "expresslane:batches_open", status="in_progress") == 1
            os.killpg(server.proc.pid, signal.SIGKILL)  # the API process and the engine, no goodbye
            server.proc.wait()
            server.stop()
            server, client = start(url)
            after = client.batches.retrieve(batch_id)
            assert after.request_counts.completed >= seen.request_counts.completed  # nothing written was lost
        done = wait_batch(client, batch_id)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (N, N, 0)
        lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert len(lines) == N
        assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(N))
        assert all(x["response"]["status_code"] == 200 for x in lines)
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == TOKENS for x in lines)
        assert done.error_file_id is None
    finally:
        server.stop()
