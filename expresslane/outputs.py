"""What `LLM.generate` and `LLM.embed` return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestMetrics:
    """Monotonic timestamps (``time.monotonic()``, comparable across processes)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at a position (vLLM's): its rank there (1: the most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: None for the first prompt token, then per position token id -> Logprob
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one input's pooled vector (normalised and truncated as asked)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput` (a `PoolingRequestOutput` of an `EmbeddingOutput`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    num_cached_tokens: int = 0
