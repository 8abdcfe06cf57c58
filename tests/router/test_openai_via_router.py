"""`expresslane router` in front of two real `expresslane serve` replicas passes the
OpenAI-client tests of one server (tests/server/test_openai_api.py and test_responses_api.py's text,
stream and forced-call tests, reused as they are: `server` below is the router; `llm` is the offline
greedy reference)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server.conftest import API_KEY, Server, llm  # noqa: F401  (`llm`: the shared fixture)
from server.test_openai_api import (  # noqa: F401  (collected here, run against the router)
    test_batched_prompts_and_logprobs, test_chat_greedy_and_stream_equal_offline,
    test_completion_greedy_equals_offline_with_usage, test_completion_stream_with_usage_equals_offline,
    test_generate_json_and_stream, test_n2_seeded_is_reproducible_and_matches_offline,
    test_prefix_cache_hit_reported_as_cached_tokens, test_stop_string_cuts_text_streamed_or_not)

from server.test_responses_api import (  # noqa: F401  (the Responses API through the router)
    test_forced_call_plain_and_streamed, test_stream_events_add_up_to_the_response, test_text_matches_chat_completions)

from openai import OpenAI

from .conftest import router


class Routed:
    """What the reused tests read of a server: its URL and auth headers."""

    def __init__(self, url: str):
        self.url, self.api_key = url, API_KEY
        self.headers = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def replicas():
    servers = [Server(), Server()]
    try:
        yield [s.wait_ready() for s in servers]
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="module")
def server(replicas):
    r = router([s.url for s in replicas]).wait_ready()
    try:
        yield Routed(r.url)
    finally:
        r.stop()


@pytest.fixture(scope="module")
def openai_client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_both_replicas_served_and_keys_are_checked(server, replicas, openai_client):
    def one(i):
        return openai_client.completions.create(model="tiny", prompt=f"spread {i} " * 40, max_tokens=2)

    with ThreadPoolExecutor(8) as pool:  # concurrent: each one's pending tokens count for the next
        list(pool.map(one, range(16)))
    served = [s.metrics().get('expresslane:request_success_total{finished_reason="length",lane="interactive",'
                              'model_name="tiny"}', 0.0) for s in replicas]
    assert all(n > 0 for n in served), served
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30)
    assert r.status_code == 401  # the replica's answer, passed through
