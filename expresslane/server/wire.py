"""Messages between the API process and the engine process (msgspec over ZeroMQ PUSH/PULL)."""

from __future__ import annotations

import msgspec

from expresslane.contract import EngineCoreOutput, EngineCoreRequest, LoRARequest, StepStats


ADD_PIECE_TOKENS = 32_768  # prompt tokens per Add message at most (unless one prompt is longer)


class Add(msgspec.Struct, tag=True):
    requests: list[EngineCoreRequest]  # a parent's n children (or several prompts) at once


def add_messages(requests: list[EngineCoreRequest]) -> list[Add]:
    """One HTTP request's engine requests as Add messages of at most ADD_PIECE_TOKENS prompt
    tokens each: the engine admits a large request a piece per step (``server/inbox.py``)."""
    pieces: list[Add] = []
    tokens = 0
    for req in requests:
        if not pieces or tokens + len(req.prompt_token_ids) > ADD_PIECE_TOKENS:
            pieces.append(Add([]))
            tokens = 0
        pieces[-1].requests.append(req)
        tokens += len(req.prompt_token_ids)
    return pieces


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class Profile(msgspec.Struct, tag=True):
    start: bool  # True: start recording; False: stop and write the trace


class Profiled(msgspec.Struct, tag=True):
    """The engine's answer to ``Profile``: the trace written (on stop), or why it refused."""

    trace: str | None = None
    error: str | None = None
    status: int = 200  # the HTTP status the API answers with: 400 (wrong state) or 500 (the trace failed)


class LoadLoRA(msgspec.Struct, tag=True):
    lora: LoRARequest


class UnloadLoRA(msgspec.Struct, tag=True):
    lora_int_id: int


class LoRADone(msgspec.Struct, tag=True):
    """The engine's answer to ``LoadLoRA`` or ``UnloadLoRA``, in order: None, or why it refused
    and the HTTP status to answer with (400: a bad adapter; 404: no such adapter)."""

    error: str | None = None
    status: int = 200


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    num_kv_blocks: int
    step_cost: dict = {}  # the engine's fitted step-cost model (StepCostModel.to_dict), for /load
    max_num_batched_tokens: int = 0
    scheduling_policy: str | None = None  # filled by the engine (None: an engine that did not say)
    runner_type: str = "generate"  # generate or pooling (embeddings): the routes the API serves
    hidden_size: int = 0  # the pooled vectors' length (`dimensions` is checked against it)
    vocab_size: int = 0  # for a config.json that leaves it at its class default (a multimodal one's text part)
    pd_lanes: str | None = None  # filled by the engine


class Failed(msgspec.Struct, tag=True):
    message: str


class Outputs(msgspec.Struct, tag=True):
    """What one turn of the engine loop produced, and the engine's state after it."""

    outputs: list[EngineCoreOutput]
    stats: StepStats
    timestamp: float  # monotonic time at the end of the turn (the tokens' emission time)
    received: dict[str, float] = {}  # request id -> when the engine took it (its own TTFT start)
    rejected: dict[str, str] = {}  # request id -> why add_request refused it


class OutputsIn(msgspec.Struct, tag="Outputs"):
    """``Outputs`` as the API process reads it: each output is decoded on its own, so a
    malformed one fails its request only (``EngineCoreOutput`` bytes, see ``outputs``)."""

    outputs: list[msgspec.Raw]
    stats: StepStats
    timestamp: float
    received: dict[str, float] = {}
    rejected: dict[str, str] = {}


class OutputId(msgspec.Struct):
    """The one field of an output that names its request: enough to fail it when the rest is malformed."""

    request_id: str


ToEngine = Add | Abort | Shutdown | Profile | LoadLoRA | UnloadLoRA
FromEngine = Ready | Failed | OutputsIn | Profiled | LoRADone  # what the API process decodes (the engine encodes Outputs)
