"""API keys and their rate limits: requests per second and tokens per minute, per key.

Keys come from ``--api-key`` (no limits, named ``default``) and ``--api-key-file``, a
TOML file with one table per key::

    [keys.team-a]
    key = "sk-team-a-..."
    requests_per_second = 5       # optional: no limit when absent
    tokens_per_minute = 20000     # optional: prompt tokens + max_tokens, for every completion (n)

Each limit is a token bucket (capacity: one second of requests, at least 1; one minute
of tokens), so a key may burst up to its limit and then runs at its rate. A request
over a limit gets 429 with ``Retry-After`` (when the bucket will hold enough); other
keys are unaffected. A generation request is charged its prompt tokens plus the
``max_tokens`` it may produce (``max_model_len`` minus the prompt when unset), for each of
its ``n`` completions, when it is admitted. Counters per key name (never the secret)
are in ``/metrics``.
"""

from __future__ import annotations

import hmac
import math
import time
import tomllib
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter

from expresslane.server import errors


@dataclass(slots=True)
class Bucket:
    rate: float  # units per second
    capacity: float
    level: float = field(init=False)
    stamp: float | None = None

    def __post_init__(self) -> None:
        self.level = self.capacity

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` now and return 0, or return the seconds until it could be taken (nothing taken)."""
        if self.stamp is not None:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate


@dataclass(slots=True)
class ApiKey:
    name: str
    key: str
    requests_per_second: float | None = None
    tokens_per_minute: float | None = None
    requests: Bucket | None = None
    tokens: Bucket | None = None

    def __post_init__(self) -> None:
        if self.requests_per_second is not None:
            self.requests = Bucket(self.requests_per_second, max(1.0, self.requests_per_second))
        if self.tokens_per_minute is not None:
            self.tokens = Bucket(self.tokens_per_minute / 60, self.tokens_per_minute)


def token_cost(prompts: list[tuple[str | None, list[int]]], params, max_model_len: int) -> int:
    """What a generation request is charged: prompt + the most it may generate, for each completion."""
    return params.n * sum(len(ids) + (params.max_tokens or max_model_len - len(ids)) for _, ids in prompts)


def load_key_file(path: str) -> list[ApiKey]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--api-key-file {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--api-key-file {path!r}: not valid TOML ({e})") from None
    tables = data.get("keys")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"--api-key-file {path!r}: no [keys.NAME] tables")
    keys = []
    for name, t in tables.items():
        where = f"--api-key-file {path!r}, [keys.{name}]"
        if not isinstance(t, dict) or not isinstance(t.get("key"), str) or not t["key"]:
            raise ValueError(f"{where}: 'key' must be a non-empty string")
        unknown = set(t) - {"key", "requests_per_second", "tokens_per_minute"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        limits = {}
        for field_name in ("requests_per_second", "tokens_per_minute"):
            v = t.get(field_name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"{where}: {field_name!r} must be a positive number")
            limits[field_name] = None if v is None else float(v)
        keys.append(ApiKey(name, t["key"], **limits))
    if len({k.key for k in keys}) != len(keys):
        raise ValueError(f"--api-key-file {path!r}: two names share one key")
    return keys


class KeyRing:
    def __init__(self, keys: list[ApiKey], registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.clock = clock
        self.requests = self.tokens = None
        if registry is not None:
            self.requests = Counter("expresslane:api_key_requests", "Requests per API key, by outcome (accepted, "
                                    "rate_limited).", ("key", "outcome"), registry=registry)
            self.tokens = Counter("expresslane:api_key_tokens", "Tokens charged to an API key's tokens-per-minute "
                                  "limit (prompt + max_tokens).", ("key",), registry=registry)
            for k in keys:
                for outcome in ("accepted", "rate_limited"):
                    self.requests.labels(k.name, outcome)
                self.tokens.labels(k.name)

    @classmethod
    def from_settings(cls, api_key: str | None, api_key_file: str | None,
                      registry: CollectorRegistry | None = None) -> "KeyRing | None":
        """None when the server takes any request (neither flag given)."""
        keys = load_key_file(api_key_file) if api_key_file else []
        if api_key:
            keys.append(ApiKey("default", api_key))
        return cls(keys, registry) if keys else None

    def authenticate(self, authorization: str | None) -> ApiKey:
        scheme, _, secret = (authorization or "").partition(" ")
        secret_b = secret.strip().encode()
        found = None
        for k in self.keys:  # every key compared, in constant time: no timing hint of which prefix matched
            if hmac.compare_digest(secret_b, k.key.encode()):
                found = k
        if scheme.lower() != "bearer" or found is None:
            raise errors.unauthorized()
        return found

    def charge_request(self, key: ApiKey) -> None:
        if key.requests is not None:
            wait = key.requests.take(1, self.clock())
            if wait:
                self._refuse(key, "requests", f"{key.requests_per_second:g} requests per second", wait)
        self._count(key, "accepted")

    def charge_tokens(self, key: ApiKey, tokens: int) -> None:
        if key.tokens is None:
            return
        if tokens > key.tokens.capacity:
            raise errors.bad_request(f"this request needs {tokens} tokens (prompt + max_tokens), more than the API "
                                     f"key's limit of {key.tokens_per_minute:g} tokens per minute; lower max_tokens",
                                     "max_tokens", "request_too_large")
        wait = key.tokens.take(tokens, self.clock())
        if wait:
            self._refuse(key, "tokens", f"{key.tokens_per_minute:g} tokens per minute", wait)
        if self.tokens is not None:
            self.tokens.labels(key.name).inc(tokens)

    def _count(self, key: ApiKey, outcome: str) -> None:
        if self.requests is not None:
            self.requests.labels(key.name, outcome).inc()

    def _refuse(self, key: ApiKey, kind: str, limit: str, wait: float) -> None:
        self._count(key, "rate_limited")
        retry = max(1, math.ceil(wait))
        raise errors.APIError(429, f"rate limit reached for API key {key.name!r}: {limit}; retry after {retry} s",
                              kind, None, "rate_limit_exceeded", {"Retry-After": str(retry)})
