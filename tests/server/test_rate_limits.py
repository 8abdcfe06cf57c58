"""Per-API-key rate limits: over a key's limit, 429 + Retry-After; other keys are unaffected."""

from __future__ import annotations

import httpx
import pytest

from expresslane.server import errors
from expresslane.server.api_keys import ApiKey, KeyRing, load_key_file

from .conftest import Server, metric

KEYS = """
[keys.slow]
key = "sk-slow"
requests_per_second = 0.001

[keys.thrifty]
key = "sk-thrifty"
tokens_per_minute = 100

[keys.free]
key = "sk-free"
"""


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_buckets_refill_at_their_rate_in_simulated_time():
    clock = Clock()
    ring = KeyRing([ApiKey("a", "k", requests_per_second=2, tokens_per_minute=600)], clock=clock)
    [key] = ring.keys
    ring.charge_request(key)
    ring.charge_request(key)  # a burst of one second's worth
    with pytest.raises(errors.APIError) as e:
        ring.charge_request(key)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"} and e.value.type == "requests"
    clock.t = 0.5  # half a second: one more request
    ring.charge_request(key)
    ring.charge_tokens(key, 600)
    with pytest.raises(errors.APIError) as e:
        ring.charge_tokens(key, 50)  # 10 tokens a second: 5 s away
    assert e.value.headers == {"Retry-After": "5"} and e.value.code == "rate_limit_exceeded"
    clock.t = 5.5
    ring.charge_tokens(key, 50)
    with pytest.raises(errors.APIError) as e:
        ring.charge_tokens(key, 601)  # can never fit: the request's fault, not a wait
    assert e.value.status == 400 and e.value.code == "request_too_large"


def test_key_files_are_checked(tmp_path):
    bad = {"no tables": "x = 1\n", "no key": "[keys.a]\nrequests_per_second = 1\n",
           "bad limit": '[keys.a]\nkey = "k"\nrequests_per_second = -1\n',
           "unknown": '[keys.a]\nkey = "k"\nrpm = 5\n', "shared": '[keys.a]\nkey = "k"\n[keys.b]\nkey = "k"\n',
           "toml": "[keys.a\n"}
    for what, text in bad.items():
        p = tmp_path / f"{what}.toml"
        p.write_text(text)
        with pytest.raises(ValueError, match="--api-key-file"):
            load_key_file(str(p))
    with pytest.raises(ValueError, match="No such file"):
        load_key_file(str(tmp_path / "absent.toml"))


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    s = Server("--api-key-file", str(path), "--batch-store", "none", api_key=None)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def post(server, key: str, **body) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 4, **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def test_a_key_over_its_limit_gets_429_and_other_keys_do_not(limited):
    assert post(limited, "sk-slow").status_code == 200
    r = post(limited, "sk-slow")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 900 <= int(r.headers["Retry-After"]) <= 1000  # one request per 1,000 s
    assert "'slow'" in r.json()["error"]["message"]
    assert post(limited, "sk-thrifty", max_tokens=80).status_code == 200  # ~85 of its 100 tokens a minute
    r = post(limited, "sk-thrifty", max_tokens=80)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens" and int(r.headers["Retry-After"]) >= 30
    r = post(limited, "sk-thrifty", max_tokens=200)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
    for _ in range(5):  # the unlimited key never waits for the others
        assert post(limited, "sk-free").status_code == 200
    assert post(limited, "sk-nope").status_code == 401
    m = limited.metrics()
    assert metric(m, "expresslane:api_key_requests_total", key="slow", outcome="rate_limited") == 1
    assert metric(m, "expresslane:api_key_requests_total", key="slow", outcome="accepted") == 1
    assert metric(m, "expresslane:api_key_requests_total", key="free", outcome="accepted") == 5
    assert metric(m, "expresslane:api_key_tokens_total", key="thrifty") > 80
