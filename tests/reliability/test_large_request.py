"""One valid request of 256 prompts of 2,047 token ids (2.1 MB, within every cap) must not freeze
other streams (issue #44 item 2). A timed acceptance check on the 2-core CPU, so `slow` (not in CI):

    python -m pytest -m reliability tests/reliability/test_large_request.py -s

A stream decodes alone first (its batch-1 inter-token gap at each context length: a decode's
step grows with its context, ~2.5x over these 2,000 tokens on this CPU); then it decodes again beside the large
request, while another client sends short requests one after another and /health is probed every
20 ms, for WINDOW seconds, after which the large request's
client leaves (the engine aborts it; it would take minutes here). Pass: once the request is in
(ADMISSION seconds after it was sent), each of the stream's gaps is within 2x its batch-1 gap at
the same context (the median alone over the neighbouring positions) plus one step at the
interactive budget (the lane's tpot target), every short request's first token comes
within the interactive TTFT target (one request's 256 prompts held every seat: a new request
waited seconds), and /health answers within 100 ms.
The gap around the admission itself is held to the same bound: the API process pauses between
decoding, validating, tokenizing and sending the body, and the engine admits the request's
pieces a few per step (server/inbox.py).
The test client runs on one core once the server is up; the server's processes may use both.
The deterministic part (the policy's decisions) is tests/test_large_request.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import httpx
import pytest

from .conftest import Server

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

WINDOW = 30.0
STREAM_TOKENS = 2000  # more than the stream decodes in WINDOW beside the request
ADMISSION = 0.5  # seconds after the large request is sent: its body parsed, its prompts in the engine
TPOT, TTFT = 0.025, 0.2  # the interactive lane's default targets (lanes.DEFAULT_LANE_SLO)
LARGE = {"prompt": [[(i * 7919 + j) % 2000 + 10 for i in range(2047)] for j in range(256)], "max_tokens": 1}


async def _stream_gaps(http: httpx.AsyncClient, tokens: int, until: asyncio.Event | None = None
                       ) -> list[tuple[float, float]]:
    """(when it began, its length) of each gap between the stream's chunks (the first token's wait
    excluded), in order: gap i follows the stream's token i."""
    gaps, last = [], None
    async with http.stream("POST", "/v1/completions", json={"prompt": "beside", "max_tokens": tokens,
                                                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append((last, now - last))
            last = now
            if until is not None and until.is_set():
                break
    return gaps


async def _first_tokens(http: httpx.AsyncClient, until: asyncio.Event) -> list[float]:
    """Short streamed requests one after another until `until`: each one's time to its first token."""
    waits = []
    while not until.is_set():
        t0 = time.monotonic()
        async with http.stream("POST", "/v1/completions", json={"prompt": f"newcomer {len(waits)}", "max_tokens": 16,
                                                                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            first = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.monotonic() - t0
        waits.append(first)
    return waits


def alone_at(alone: list[float], i: int, around: int = 16) -> float:
    """The batch-1 gap at the stream's position i: the median alone over positions i +- around."""
    return statistics.median(alone[max(0, min(i, len(alone) - 1) - around):i + around + 1])


async def _beside_the_large_request(s: Server) -> tuple[list[float], list[tuple[int, float]], list[float],
                                                        tuple[int, float], list[float]]:
    """The stream's gaps alone; its (position, gap) once the request is in; the /health times;
    the largest (position, gap) around the admission; the short requests' TTFTs."""
    async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=600) as http:
        alone = await _stream_gaps(http, STREAM_TOKENS)
        done = asyncio.Event()
        health: list[float] = []

        async def probe() -> None:
            while not done.is_set():
                t0 = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                health.append(time.monotonic() - t0)
                await asyncio.sleep(0.02)

        body = json.dumps(LARGE).encode()  # before the stream starts: encoding it holds this client's loop ~50 ms
        stream = asyncio.create_task(_stream_gaps(http, STREAM_TOKENS, done))
        await asyncio.sleep(1.0)  # the stream is decoding
        prober = asyncio.create_task(probe())
        sent = time.monotonic()
        large = asyncio.create_task(http.post("/v1/completions", content=body,
                                              headers={"content-type": "application/json"}))
        newcomers = asyncio.create_task(_first_tokens(http, done))
        await asyncio.sleep(WINDOW)
        assert not large.done(), large.result().text[:300]  # still in flight at the end of the window
        large.cancel()  # the client leaves; the engine aborts its 256 prompts
        done.set()
        gaps = await stream
        await prober
        ttfts = await newcomers
        admission = max(((i, g) for i, (t, g) in enumerate(gaps) if sent - 0.1 < t < sent + ADMISSION),
                        key=lambda x: x[1])
        return ([g for _, g in alone], [(i, g) for i, (t, g) in enumerate(gaps) if t >= sent + ADMISSION], health,
                admission, ttfts)


def test_a_256_prompt_request_does_not_freeze_other_streams():
    # the step-cost model calibrated on this machine, as a deployment runs (the suite's default is nominal)
    s = Server("--num-kv-blocks", "16384", "--max-num-seqs", "256", "--max-model-len", "2048",
               "--step-cost-model", "calibrate").wait_ready()
    try:
        os.sched_setaffinity(0, {0})  # this client on one core (a deployment's clients are not on its cores)
        alone, beside, health, admission, ttfts = asyncio.run(_beside_the_large_request(s))
        bound = lambda i: 2 * alone_at(alone, i) + TPOT  # noqa: E731
        over = [(i, g, bound(i)) for i, g in beside + [admission] if g > bound(i)]
        gaps = [g for _, g in beside]
        p99 = sorted(gaps)[int(0.99 * len(gaps))]
        worst = max(beside, key=lambda x: x[1] / bound(x[0]))
        print(f"\nbatch-1 gap median {statistics.median(alone[:64]) * 1e3:.1f} ms over the first 64 tokens, "
              f"{statistics.median(alone[-64:]) * 1e3:.1f} ms over the last 64; beside the 256 x 2,047-id request "
              f"({WINDOW:.0f} s, {len(beside)} gaps after its admission, positions {beside[0][0]}-{beside[-1][0]}): "
              f"median {statistics.median(gaps) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {max(gaps) * 1e3:.1f} ms; "
              f"closest to its bound: {worst[1] * 1e3:.1f} ms at position {worst[0]} (bound {bound(worst[0]) * 1e3:.1f} "
              f"ms); around the admission {admission[1] * 1e3:.1f} ms (bound {bound(admission[0]) * 1e3:.1f} ms); "
              f"{len(over)} over; {len(ttfts)} short requests meanwhile: TTFT median "
              f"{statistics.median(ttfts) * 1e3:.1f} ms, max {max(ttfts) * 1e3:.1f} ms; /health max "
              f"{max(health) * 1e3:.1f} ms over {len(health)} probes")
        assert not over and max(ttfts) <= TTFT and max(health) < 0.1, over
    finally:
        s.stop()
