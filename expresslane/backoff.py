"""When to retry a request and how long to wait: ``Retry-After`` first, else jittered exponential backoff.

A server that says how long to wait (``Retry-After: 7`` or an HTTP date, on a 429 or
503) is believed, up to ``max_wait``, plus a little jitter so that the clients it
turned away do not all come back in the same instant. Without it, "full jitter"
backoff: a uniform draw in [0, min(cap, base * 2**attempt)]. Shared by ``expresslane.client``
and the benchmark client (stdlib only).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

RETRY_STATUS = frozenset({408, 429, 502, 503, 504})


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date); None if absent or bad."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


@dataclass(frozen=True, slots=True)
class Backoff:
    max_retries: int = 5  # retries after the first attempt
    base: float = 0.5  # seconds: the first backoff window
    cap: float = 30.0  # seconds: the largest backoff window
    max_wait: float = 300.0  # a longer Retry-After is cut to this
    jitter: float = 0.1  # extra fraction of a stated Retry-After, drawn uniformly

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base <= 0 or self.cap <= 0 or self.max_wait < 0 or self.jitter < 0:
            raise ValueError("Backoff: max_retries, base, cap, max_wait and jitter must be non-negative "
                             "(base and cap positive)")

    def delay(self, attempt: int, retry_after: str | None, rng: random.Random) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based)."""
        stated = parse_retry_after(retry_after)
        if stated is not None:
            stated = min(stated, self.max_wait)
            return stated + rng.uniform(0, self.jitter * max(stated, self.base))
        return rng.uniform(0, min(self.cap, self.base * 2 ** attempt))
