"""Request state inside the engine core (torch-free)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from expresslane.contract import EngineCoreRequest, NewRequest, ScoredPrompt
from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival_counter = itertools.count()


def check_prompt_length(num_tokens: int, max_model_len: int, pooling: bool = False) -> None:
    """A pooling request samples nothing: its prompt may fill the context."""
    if num_tokens == 0:
        raise ValueError("the prompt is empty")
    if pooling and num_tokens > max_model_len:
        raise ValueError(f"the input has {num_tokens} tokens; this model's maximum context length is "
                         f"{max_model_len} tokens")
    if not pooling and num_tokens >= max_model_len:
        raise ValueError(f"the prompt has {num_tokens} tokens; this model's maximum context length is "
                         f"{max_model_len} tokens, which must hold the prompt and at least one output token")


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int
    max_tokens: int
    max_model_len: int
    lane: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when scheduled
    num_pending: int = 0  # sampled by a step in flight (0 or 1)
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling
    num_preemptions: int = 0
    num_blocks_sent: int = 0  # block ids the runner has
    num_draft_computed: int = 0  # tokens a draft model's cache holds (speculative decoding)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    ttft_deadline: float | None = None  # DeadlinePolicy.deadline
    request_prompt_tokens: int = 0  # of the whole frontend request; 0: its own
    # prompt positions scored (kept across preemption); scores go with the first token
    num_prompt_logprobs_scheduled: int = 0
    prompt_logprobs: ScoredPrompt | None = None
    lora_id: int = 0
    cache_salt: bytes | None = None
    pooling_params: PoolingParams | None = None  # resolved; an embeddings request: one "sample", pooled
    rope_length: int = 0  # what length-dependent RoPE sees (layers/rotary.py)
    seq: int = field(default_factory=lambda: next(_arrival_counter))  # tie-break

    @classmethod
    def from_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> "Request":
        sp = req.sampling_params
        room = max_model_len - len(req.prompt_token_ids)
        max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        if req.pooling_params is not None:
            max_tokens = 1  # its last chunk's "sample" is the pooled vector: never scheduled past it
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=sp,
            eos_token_ids=frozenset(() if sp.ignore_eos else req.eos_token_ids),
            arrival_time=req.arrival_time,
            priority=req.priority,
            max_tokens=max_tokens,
            max_model_len=max_model_len,
            lane=req.lane,
            all_token_ids=list(req.prompt_token_ids),
            request_prompt_tokens=req.request_prompt_tokens,
            lora_id=req.lora_request.lora_int_id if req.lora_request else 0,
            pooling_params=req.pooling_params,
            rope_length=len(req.prompt_token_ids),
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions still to score (so no prefix-cache hit)."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.num_prompt_logprobs_scheduled < len(self.prompt_token_ids) - 1)

    @property
    def takes_prefix_hit(self) -> bool:
        """A cached prefix has no logits and no hidden states: prompt logprobs and pooling over the
        whole prompt (MEAN, CLS) compute it all."""
        if self.needs_prompt_logprobs:
            return False
        return self.pooling_params is None or self.pooling_params.pooling_type == "LAST"

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    def will_finish_by_length(self) -> bool:
        """The pending token reaches max_tokens or the context."""
        n_out = self.num_output_tokens + self.num_pending
        return n_out >= self.max_tokens or self.num_tokens_with_pending >= self.max_model_len

    def runner_state(self) -> NewRequest:
        """What the runner keeps while the request runs."""
        sp = self.sampling_params
        left = sp.min_tokens - self.num_output_tokens - self.num_pending
        n, known = len(self.prompt_token_ids), (list(self.all_token_ids) if sp.penalized or sp.bad_words_token_ids else [])
        if left <= 0 or self.pooling_params is not None:
            return NewRequest(self.request_id, sp, num_prompt_tokens=n, token_ids=known, pooling=self.pooling_params,
                              lora_id=self.lora_id, rope_length=self.rope_length)
        return NewRequest(self.request_id, sp, tuple(sorted(self.eos_token_ids | set(sp.stop_token_ids))), left, n,
                          known, lora_id=self.lora_id, rope_length=self.rope_length)

    def append_token(self, token_id: int) -> None:
        """Sets finish_reason when done."""
        self.all_token_ids.append(token_id)
        if token_id in self.eos_token_ids:  # the sampler bans EOS before min_tokens
            self.finish_reason = "stop"
        elif token_id in self.sampling_params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
