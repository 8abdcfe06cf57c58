"""A burst of 10x the admission cap at once: every answer is a 200 or a 503 with Retry-After,
and every accepted request completes in full (streams end with their last token and [DONE])."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .conftest import Server, serves_a_normal_request, sse_events

pytestmark = pytest.mark.reliability

CAP = 8  # --max-waiting-requests
BURST = 10 * CAP
TOKENS = 32
MSG = [{"role": "user", "content": "burst"}]


@pytest.fixture(scope="module")
def capped_server():
    s = Server("--max-waiting-requests", str(CAP), "--max-num-seqs", "4")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _request(i: int) -> tuple[str, dict, int]:
    """(path, body, completions it asks for): every route, streamed or not, some with n = 2."""
    common = {"max_tokens": TOKENS, "ignore_eos": True, "stream": i % 2 == 0,
              **({"stream_options": {"include_usage": True}} if i % 2 == 0 and i % 5 != 2 else {})}
    kind = i % 5
    if kind == 0:
        return "/v1/completions", {**common, "prompt": f"burst {i}"}, 1
    if kind == 1:
        return "/v1/chat/completions", {**common, "messages": MSG}, 1
    if kind == 2:
        return "/generate", {**common, "prompt": f"burst {i}"}, 1
    if kind == 3:
        return "/v1/completions", {**common, "prompt": f"burst {i}", "n": 2}, 2
    return "/v1/chat/completions", {**common, "messages": MSG, "n": 2}, 2


async def _send(http: httpx.AsyncClient, i: int) -> tuple[int, dict, list | dict]:
    path, body, _ = _request(i)
    if not body["stream"]:
        r = await http.post(path, json=body)
        return r.status_code, dict(r.headers), r.json()
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, dict(r.headers), r.json()
        return 200, dict(r.headers), sse_events([line async for line in r.aiter_lines()])


def _outcome(path: str, result) -> tuple[int, dict[int, str]]:
    """(completion tokens in all, completion index -> finish reason), from a body or SSE events."""
    if isinstance(result, dict):  # non-streamed
        if path == "/generate":
            return len(result["token_ids"]), {0: result["finish_reason"]}
        return result["usage"]["completion_tokens"], {c["index"]: c["finish_reason"] for c in result["choices"]}
    assert result[-1] == "[DONE]" and not any("error" in e for e in result[:-1]), result[-3:]
    if path == "/generate":
        return sum(len(e["token_ids"]) for e in result[:-1]), {0: result[-2]["finish_reason"]}
    reasons = {c["index"]: c["finish_reason"] for e in result[:-1] for c in e["choices"] if c["finish_reason"]}
    return result[-2]["usage"]["completion_tokens"], reasons  # the usage chunk comes last


def test_burst_of_10x_the_cap_gets_200_or_503_and_every_accepted_request_completes(capped_server):
    s = capped_server

    async def main():
        async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as http:
            return await asyncio.gather(*(_send(http, i) for i in range(BURST)))

    results = asyncio.run(main())
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    accepted = [i for i, st in enumerate(statuses) if st == 200]
    refused = [i for i, st in enumerate(statuses) if st == 503]
    assert refused, statuses
    # A refusal means the waiting sequences plus the new request's (at most 2) were over the cap,
    # and every waiting one had been accepted: the cap never refuses early.
    assert sum(_request(i)[2] for i in accepted) >= CAP - 1, statuses
    for i in refused:
        _, headers, body = results[i]
        assert int(headers["retry-after"]) >= 1 and body["error"]["code"] == "overloaded", (headers, body)
    for i in accepted:
        path, body, n = _request(i)
        outcome = _outcome(path, results[i][2])
        assert outcome == (n * TOKENS, {j: "length" for j in range(n)}), (i, path, body["stream"], outcome)
    print(f"\nburst of {BURST} over a cap of {CAP}: {len(accepted)} x 200, {len(refused)} x 503")
    serves_a_normal_request(s)
