"""The engine core's contracts, as plain data (torch-free, a leaf: imports nothing of ours
but `SamplingParams` and `PoolingParams`).

- Messages in and out of the core: ``EngineCoreRequest`` (a tokenized request from a
  frontend), ``EngineCoreOutput`` (a request's new tokens after a step) and ``StepStats``
  (the engine's state after a step, for metrics). The API process imports these, and
  only these, from the engine.
- The step plan, scheduler -> runner: ``StepPlan``. It names requests by id and carries
  only what changed since the request's previous step (new token ids, new KV block ids);
  the runner keeps each running request's state (block table, sampling parameters)
  between steps. A request the runner sees for the first time, or again after being
  preempted, comes with a ``NewRequest``. Everything is ints, strings and lists, so a
  plan can be sent to other processes (tensor parallelism) as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams


# -- messages in and out of the engine core -----------------------------------------------
@dataclass(slots=True, frozen=True)
class LoRARequest:
    """A LoRA adapter, as vLLM names it: a name (the API's `model`), an id unique among the
    engine's adapters (> 0; 0 is the base model) and a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized request, as a frontend (offline LLM or the API server) hands it to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    lane: str = "interactive"  # resolved by the frontend (lanes.py)
    # prompt tokens of the whole frontend request it is part of (its sibling prompts too: one
    # HTTP request may carry 256 prompts); 0: its own. The deadline policy ranks by this work.
    request_prompt_tokens: int = 0
    # an embeddings request (a pooling engine): its prefill ends with the pooled hidden state,
    # nothing is sampled (`sampling_params` asks for one token)
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # None: the base model


# the sampling parameters a pooling request carries: its last chunk's "sample" is its vector
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(slots=True)
class ScoredPrompt:
    """A prompt's scored positions, as the engine sends them: for prompt tokens 1, 2, ... (token 0
    has none) the token's logprob and rank (the tokens at least as likely, itself included) and the
    top-k. The frontend makes vLLM's shape of them (`RequestOutput.prompt_logprobs`)."""

    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, more: ScoredPrompt) -> None:
        self.logprobs += more.logprobs
        self.ranks += more.ranks
        self.top_ids += more.top_ids
        self.top_logprobs += more.top_logprobs


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request after one step; ``finish_reason`` set on its last."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    new_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: ScoredPrompt | None = None  # the whole prompt's, with the first token only
    pooled: list[float] | None = None  # a pooling request's embedding (its only output; finish_reason set)


@dataclass(slots=True)
class StepStats:
    """What the last step did and the engine's state after it (for metrics)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_batched_tokens: int = 0
    batch_size: int = 0
    step_duration: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0  # cumulative, tokens
    num_preemptions: int = 0  # cumulative
    # a sliding window on every layer: KV blocks freed while their request ran (cumulative), and
    # the blocks the running requests would hold without the window (now)
    window_freed_blocks: int = 0
    window_saved_blocks: int = 0
    # the step that completed during this call: its time (completion to completion, when it
    # ran right behind the one before; 0 otherwise) and what the step-cost model predicted
    step_time: float = 0.0
    predicted_step_time: float = 0.0
    # speculative decoding, cumulative (vLLM's spec_decode_* counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # mixtures of experts, now and then (when a copy of the device counters has landed; else None):
    # per sparse layer index, the tokens routed to each expert since start (cumulative)
    expert_tokens: dict[int, list[int]] | None = None
    # LoRA adapters (None: enable_lora is off): the names of those running and waiting (comma-joined,
    # sorted), the slots, and the adapters loaded (read and checked) since start, cumulative
    lora_running: str | None = None
    lora_waiting: str | None = None
    max_loras: int = 0
    lora_loads: int = 0
    # two lanes (pd_lanes on; all 0 off): the SMs of the current split, and each lane's seconds with
    # a step in flight (launch to landing, cumulative)
    decode_lane_sms: int = 0
    prefill_lane_sms: int = 0
    decode_lane_busy_s: float = 0.0
    prefill_lane_busy_s: float = 0.0


# -- the step plan: scheduler -> runner -------------------------------------------------------
@dataclass(slots=True)
class NewRequest:
    """What the runner keeps about a request from its first step until it finishes or is
    preempted (then it comes again, as new, when it is readmitted)."""

    request_id: str
    sampling_params: SamplingParams
    # EOS and stop token ids, banned for this request's next `num_banned_samples` samples
    # (`min_tokens` not reached yet); the runner counts the samples down itself
    banned_token_ids: tuple[int, ...] = ()
    num_banned_samples: int = 0
    # penalties: its prompt's length, and every token it holds so far (a preempted request comes
    # back with its outputs; a prefix-cache hit skips computing the prompt); empty without penalties
    # or bad words
    num_prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    # a pooling request (resolved: every field set): its seqs' hidden states are pooled, its
    # last chunk's `sample` pools instead of sampling
    pooling: PoolingParams | None = None
    lora_id: int = 0  # its LoRA adapter's id (0: the base model); the runner holds the adapter already
    rope_length: int = 0  # the length RoPE that depends on it sees (Request.rope_length); 0: the prompt's


# The block-table entry of a position whose block the KV manager freed (out of its group's
# sliding window) or never held (before a windowed prefix-cache hit): no kernel reads it.
NULL_BLOCK_ID = 0


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens to compute now (a placeholder where `from_previous`)
    start_pos: int  # position of token_ids[0] = tokens already in the KV cache
    # appended to the request's block tables, one KV group's after another, as many each (all of it
    # when it is new; NULL_BLOCK_ID)
    new_block_ids: list[int]
    sample: bool  # this step reaches the request's last token: sample the next one
    # the (single) input token is the one this request sampled in the previous step, still
    # on the device: the runner takes it from there
    from_previous: bool = False
    # speculative decoding: the last `num_spec_tokens` of token_ids are proposals (placeholders
    # the runner's draft model fills, with a draft model); the runner verifies them and
    # returns the accepted ones and one token of the target's own (1 to num_spec_tokens + 1)
    num_spec_tokens: int = 0
    # a draft model's catch-up: the tokens before token_ids[0] its cache lacks (it computes only
    # when a request speculates), from position start_pos - len(draft_token_ids)
    draft_token_ids: list[int] = field(default_factory=list)
    # structured outputs: this seq's row of StepPlan.token_bitmask (-1: unconstrained)
    bitmask_row: int = -1
    # prompt logprobs: token_ids[prompt_logprobs_from + j] scores prompt token prompt_logprob_targets[j]
    # (the prompt token after it; the last row of a chunk scores the next chunk's first token)
    prompt_logprobs_from: int = 0
    prompt_logprob_targets: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """One step, as the runner executes it. Applied in order: the runner first forgets
    `finished_request_ids` and `preempted_request_ids` (either may name a request it never
    saw), then takes in `new_requests`, then runs `seqs`."""

    step_id: int
    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the last plan
    preempted_request_ids: list[str] = field(default_factory=list)  # since the last plan
    # structured outputs: int32 [rows, ceil(vocab / 32)], bit j of word w allows token 32w + j
    # (a numpy array; None when no seq of the step is constrained)
    token_bitmask: object = None
    # two lanes: "prefill" or "decode"; a seq's token from the previous step comes from its lane's
    lane: str | None = None
    split_sms: int = 0  # the split's decode SMs while both lanes run (0: this lane has every SM)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
