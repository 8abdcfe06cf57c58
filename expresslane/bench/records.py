"""The measurement of one request, and result JSON files.

A ``RequestRecord`` is what every benchmark produces per request, whatever drove it
(HTTP client, simulated user, in-process engine). Times are seconds on one monotonic
clock; only differences are meaningful.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class RequestRecord:
    input_len: int
    start: float = 0.0  # when the request was sent
    end: float = 0.0  # when it finished or failed
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0  # start -> first content token
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    latency: float = 0.0  # start -> last token (end-to-end)
    error: str = ""  # "Kind: detail"; empty on success
    length_class: str = "short"  # "short" | "long"
    lane: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache
    server_metrics: dict | None = None  # expresslane's return_metrics: the engine's timestamps
    text: str = ""  # the generated text (HTTP runs; not written to the result)
    output_count: str = "exact"  # how output_len was counted: exact | usage | tokenizer | chunks

    @property
    def tpot(self) -> float | None:
        """Time per output token, first token excluded (vLLM's definition)."""
        if not self.success or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def error_kind(self) -> str:
        return self.error.split(":", 1)[0]


def per_request_lists(records: list[RequestRecord], t0: float) -> dict:
    """Per-request columns, aligned by index, in vLLM's keys and units (seconds);
    ``start_times`` count from the run's start (vLLM writes raw perf_counter readings).

    Failed requests stay in every list (zeros and a non-empty ``errors`` entry), so
    indices line up and nothing is silently dropped.
    """
    return {
        "input_lens": [r.input_len for r in records],
        "output_lens": [r.output_len for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start - t0 for r in records],
        "classes": [r.length_class for r in records],
        "lanes": [r.lane for r in records],
        "errors": [r.error for r in records],
        # ours: usage.prompt_tokens_details.cached_tokens where the server reports it
        "cached_tokens": [r.cached_tokens for r in records],
    }


def first_errors(errors: list[str], limit: int = 5) -> list[tuple[str, int]]:
    """The first ``limit`` distinct error messages, in order of first appearance, with counts."""
    counts: dict[str, int] = {}
    for e in errors:
        if e:
            counts[e] = counts.get(e, 0) + 1
    return list(counts.items())[:limit]


def json_number(x: float) -> float | str:
    """vLLM writes an infinite request rate as the string "inf" (JSON has no inf)."""
    return "inf" if math.isinf(x) else x


def save_result(result: dict, path: str | Path) -> None:
    # allow_nan=False: a NaN would make the file unreadable to strict JSON parsers.
    Path(path).write_text(json.dumps(result, indent=2, allow_nan=False))


def load_result(path: str | Path) -> dict:
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or "kind" not in result:
        raise ValueError(f"{path}: not an expresslane bench result (no 'kind' key)")
    return result
