"""Admission caps (503 + Retry-After) and priority ordering, on a server that runs one request at a time."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .conftest import Server, metric


async def hold_the_slot(http: httpx.AsyncClient) -> asyncio.Task:
    """A long stream that holds the server's only slot until its task is cancelled."""
    running = asyncio.Event()

    async def blocker() -> None:
        async with http.stream("POST", "/generate", json={"prompt": "blocker", "max_tokens": 2000,
                                                          "ignore_eos": True, "stream": True}) as r:
            async for _ in r.aiter_lines():
                running.set()

    task = asyncio.create_task(blocker())
    await running.wait()
    return task


async def wait_for_metric(server: Server, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a figure
    while metric(server.metrics(), name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def small_server():
    s = Server("--max-waiting-requests", "4", "--scheduling-policy", "priority", "--max-num-seqs", "1",
               "--max-model-len", "2048")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_burst_over_the_waiting_cap_gets_503s_and_accepted_requests_complete(small_server):
    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        return await http.post("/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 4, "ignore_eos": True})

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, headers=small_server.headers, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(50)))

    responses = asyncio.run(main())
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(accepted) + len(refused) == 50
    assert len(accepted) >= 4 and refused
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
    for r in accepted:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(small_server.url + "/health").status_code == 200


def test_the_waiting_cap_counts_sequences_not_http_requests(small_server):
    """--max-waiting-requests 4 counts prompts × n: 3 prompts × n=2 never fit (400, even with nothing
    waiting), 2 × 2 fill the cap, and then a single sequence waits for room (503)."""
    s = small_server
    body = {"max_tokens": 2, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=120) as http:
            too_big = await http.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"], "n": 2})
            blocking = await hold_the_slot(http)
            four = asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": ["x", "y"], "n": 2}))
            await wait_for_metric(s, "expresslane:num_requests_waiting", 4)
            one_more = await http.post("/v1/completions", json={**body, "prompt": "z"})
            blocking.cancel()
            return too_big, one_more, await four

    too_big, one_more, four = asyncio.run(main())
    assert too_big.status_code == 400, too_big.text
    err = too_big.json()["error"]
    assert err["code"] == "request_too_large" and "6 sequences" in err["message"]
    assert "--max-waiting-requests" in err["message"]
    assert one_more.status_code == 503 and one_more.json()["error"]["code"] == "overloaded"
    assert "4 sequences (prompts × n) waiting" in one_more.json()["error"]["message"]
    assert four.status_code == 200 and sorted(c["index"] for c in four.json()["choices"]) == [0, 1, 2, 3]


def test_lower_priority_value_runs_first(small_server):
    """With one slot busy, a later request with priority -5 overtakes an earlier one with priority 5."""
    body = {"max_tokens": 2, "ignore_eos": True, "return_metrics": True}

    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, headers=small_server.headers, timeout=120) as http:
            blocking = await hold_the_slot(http)
            late = asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": "b", "priority": 5}))
            await wait_for_metric(small_server, "expresslane:num_requests_waiting", 1)  # it arrived first
            urgent = asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": "c", "priority": -5}))
            await wait_for_metric(small_server, "expresslane:num_requests_waiting", 2)
            blocking.cancel()  # the client leaves: its abort frees the slot for the queue
            return (await late).json(), (await urgent).json()

    late, urgent = asyncio.run(main())
    assert late["metrics"]["arrival_time"] < urgent["metrics"]["arrival_time"]
    assert urgent["metrics"]["finished_time"] <= late["metrics"]["first_scheduled_time"]


def test_clients_gone_while_queued_are_aborted_before_running(small_server):
    s = small_server
    before = metric(s.metrics(), "expresslane:request_success_total", finished_reason="abort")

    async def main():
        async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=60) as http:
            async def queued_stream(i: int) -> None:
                with pytest.raises(httpx.ReadTimeout):  # nothing comes while it waits: the client gives up
                    async with http.stream("POST", "/v1/completions", json={"prompt": f"q{i}", "stream": True},
                                           timeout=httpx.Timeout(60, read=0.3)) as r:
                        async for _ in r.aiter_lines():
                            pass

            async def queued_plain() -> None:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post("/v1/completions", json={"prompt": "q"}, timeout=httpx.Timeout(60, read=0.3))

            blocking = await hold_the_slot(http)
            await asyncio.gather(queued_stream(0), queued_stream(1), queued_plain())
            deadline = time.monotonic() + 30  # "eventually": a hang guard, not a figure
            while time.monotonic() < deadline:
                m = s.metrics()
                if metric(m, "expresslane:request_success_total", finished_reason="abort") == before + 3 and \
                        metric(m, "expresslane:num_requests_waiting") == 0:
                    break
                await asyncio.sleep(0.05)
            assert not blocking.done(), "the queued requests left while the blocker still held the slot"
            blocking.cancel()
            return m

    m = asyncio.run(main())
    assert metric(m, "expresslane:request_success_total", finished_reason="abort") == before + 3
    assert metric(m, "expresslane:num_requests_waiting") == 0
    assert metric(m, "expresslane:num_requests_running") == 1


def test_slo_admission_refuses_interactive_work_that_cannot_start_in_time():
    """A 1 ms interactive TTFT target: with long prompts queued ahead, new interactive
    requests are refused early (503 + Retry-After); batch-lane ones are not."""
    s = Server("--slo-admission", "--scheduling-policy", "deadline", "--lane-slo", "interactive:ttft=1ms",
               "--max-num-seqs", "1", "--max-model-len", "2048").wait_ready()
    try:
        long_prompt = " ".join(["word"] * 600)

        async def one(http: httpx.AsyncClient, lane: str) -> httpx.Response:
            return await http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2,
                                                            "ignore_eos": True, "lane": lane})

        async def main():
            async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=120,
                                         limits=httpx.Limits(max_connections=None)) as http:
                await one(http, "interactive")  # the server learns its prefill rate
                return await asyncio.gather(*(one(http, lane) for lane in ["interactive"] * 8 + ["batch"] * 4))

        responses = asyncio.run(main())
        interactive, batch = responses[:8], responses[8:]
        refused = [r for r in interactive if r.status_code == 503]
        assert refused, [r.status_code for r in interactive]
        for r in refused:
            err = r.json()["error"]
            assert err["code"] == "slo_unattainable" and "TTFT target of 1 ms" in err["message"]
            assert int(r.headers["Retry-After"]) >= 1
        assert all(r.status_code == 200 for r in batch)  # the batch lane has no TTFT promise to keep
        assert any(r.status_code == 200 for r in interactive)  # the first of the burst always gets in
    finally:
        s.stop()


def test_return_metrics_has_the_latency_breakdown(server):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"prompt": "breakdown", "max_tokens": 3, "return_metrics": True})
    m = r.json()["metrics"]
    assert m["queue_time"] >= 0 and m["prefill_time"] >= 0 and m["decode_time"] >= 0
    total = m["finished_time"] - m["arrival_time"]
    assert m["queue_time"] + m["prefill_time"] + m["decode_time"] == pytest.approx(total, abs=1e-6)


def test_a_lane_queue_cap_refuses_that_lane_only():
    s = Server("--scheduling-policy", "deadline", "--lane-slo", "batch:queue=2", "--max-num-seqs", "1",
               "--max-model-len", "2048").wait_ready()
    try:
        async def one(http: httpx.AsyncClient, lane: str, i: int) -> httpx.Response:
            return await http.post("/v1/completions", json={"prompt": f"{lane} {i}", "max_tokens": 8,
                                                            "ignore_eos": True, "lane": lane})

        async def main():
            async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=120,
                                         limits=httpx.Limits(max_connections=None)) as http:
                blocker = await hold_the_slot(http)  # keeps the others waiting
                tasks = [asyncio.create_task(one(http, lane, i)) for i in range(6) for lane in ("batch", "interactive")]
                try:
                    # 2 batch + 6 interactive queue behind the blocker; the other 4 batch are refused.
                    await wait_for_metric(s, "expresslane:num_requests_waiting", 8)
                    deadline = time.monotonic() + 60  # a hang guard, not a figure
                    while sum(t.done() for t in tasks[0::2]) < 4:
                        assert time.monotonic() < deadline, "the refusals never came back"
                        await asyncio.sleep(0.02)
                finally:
                    blocker.cancel()  # not before: the queue must stay full until every request is in
                return await asyncio.gather(*tasks)

        responses = asyncio.run(main())
        batch = [r for i, r in enumerate(responses) if i % 2 == 0]
        interactive = [r for i, r in enumerate(responses) if i % 2 == 1]
        assert all(r.status_code == 200 for r in interactive)
        refused = [r for r in batch if r.status_code == 503]
        assert len(refused) == 4 and sum(r.status_code == 200 for r in batch) == 2
        assert all(r.json()["error"]["code"] == "lane_queue_full" for r in refused)
    finally:
        s.stop()
