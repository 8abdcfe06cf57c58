"""The server's part of the config tree: ``expresslane serve``, ``router`` and ``batch``.

Plain data, no server imports: the API process, the router and the batch tier read these
typed sections; their flags are made from them (flags.py).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import ClassVar

from expresslane.config.flags import _knob, flag_name

BUILTIN_MODEL_NAME = "tiny"  # what clients call the built-in model when no model is given


@dataclass(frozen=True, slots=True)
class ListenConfig:
    host: str = _knob("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = _knob(8000, "port to listen on")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_waiting_requests: int | None = _knob(
        None, "admission cap: sequences (prompts x n) admitted but not yet producing tokens; over it, 503 + "
        "Retry-After (a request larger than the cap on its own: 400)")
    max_waiting_tokens: int | None = _knob(
        None, "admission cap: prompt tokens of those sequences; over it, 503 + Retry-After (a request larger than "
        "the cap on its own: 400)")
    slo_admission: bool = _knob(
        False, "refuse (503 + Retry-After) interactive requests that cannot get their first token within the "
        "interactive lane's TTFT target (--lane-slo) given the prompts ahead", negatable=False)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    TITLE: ClassVar[str] = "request limits (over one: 413 or 400 naming the limit)"

    max_request_body_bytes: int = _knob(16 * 2**20, "request body size in bytes")
    max_prompt_chars: int | None = _knob(
        None, "characters of one prompt (or chat messages), checked before tokenizing (default: what the "
        "model's context could hold, max_model_len x the longest token's characters)")
    max_stop_strings: int = _knob(64, "stop strings of one request")
    max_sequences_per_request: int = _knob(256, "completions of one request: prompts x n")
    max_logprobs: int = _knob(20, "logprobs / top_logprobs of one request")


@dataclass(frozen=True, slots=True)
class BatchApiConfig:
    TITLE: ClassVar[str] = "batch API"

    batch_store: str | None = _knob(
        None, "the Batch API's durable queue: sqlite:PATH, or redis://HOST:PORT/DB[?prefix=NAME] for several "
        "servers sharing one queue; 'none' turns the Batch API off (default: "
        "sqlite:~/.cache/expresslane/batches-<served model name>.db)")
    batch_concurrency: int = _knob(256, "batch requests run at once (they wait in the engine's batch lane)")
    batch_lease_seconds: float = _knob(
        60.0, "a claimed batch request whose server stops renewing it (crash, kill -9) is taken over after this "
        "long; servers sharing a store must use the same value")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``expresslane serve``: every flag but the engine's and the positional model."""

    TITLE: ClassVar[str] = "server"

    listen: ListenConfig = field(default_factory=ListenConfig)
    api_key: str | None = _knob(None, "require 'Authorization: Bearer KEY' on /v1/*, /generate, /tokenize")
    api_key_file: str | None = _knob(
        None, "TOML file of API keys, each with optional rate limits ([keys.NAME] key = ..., requests_per_second "
        "= ..., tokens_per_minute = ...); over a limit: 429 + Retry-After")
    served_model_name: str | None = _knob(
        None, "the model name clients send and see (default: the model argument, or 'tiny')")
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    request_timeout: float | None = _knob(
        None, "seconds a request may take from arrival; then it is aborted, its KV freed (504)")
    enable_request_merging: bool = _knob(
        False, "identical concurrent requests (same prompt and parameters, greedy or seeded) share one "
        "generation; hit rate in /metrics (request_merge_hits_total / request_merge_queries_total)", negatable=False)
    shutdown_timeout: float = _knob(
        30.0, "on SIGTERM: refuse new requests and give in-flight ones this many seconds to finish; then they end "
        "with an error (streams: an SSE error event and [DONE]) and the server exits")
    engine_restarts: int = _knob(
        3, "when the engine process dies: fail the requests in flight and start a new engine (backoff 0.5 s, "
        "doubling), at most this many times in the server's life; then exit 1")
    profile_dir: str | None = _knob(
        None, "enable POST /start_profile and /stop_profile: torch profiler traces of the engine process, written "
        "here as Chrome trace JSON")
    data_parallel_size: int = _knob(
        1, "run N replicas of the server and engine (on GPU: each on its own tensor-parallel-size GPUs) behind the "
        "lane-aware router on --host/--port")
    chat_template: str | None = _knob(
        None, "the chat template for /v1/chat/completions instead of the model's: a file, or the Jinja text itself")
    allowed_origins: tuple[str, ...] = _knob(
        (), "CORS: an origin browsers may call the server from ('*': any; repeatable); none: no CORS headers",
        metavar="ORIGIN", repeat=True)
    reasoning_parser: str | None = _knob(
        None, "split a reasoning model's thinking into reasoning_content (messages and stream deltas): qwen3 "
        "(<think>...</think> when the model opens it), deepseek_r1 (thinking until </think>), openai_gptoss "
        "(harmony's analysis channel; on by itself when the chat template is harmony)",
        choices=("qwen3", "deepseek_r1", "openai_gptoss"))
    structured_outputs_enable_in_reasoning: bool = _knob(
        False, "with --reasoning-parser: a grammar holds the whole output, thinking included (vLLM's "
        "enable_in_reasoning); default: it starts after the thinking (</think>)", negatable=False)
    tool_call_parser: str = _knob(
        "auto", "how tool calls are read out of a chat completion's text when tool_choice is auto: hermes "
        "(<tool_call> JSON, also Qwen2.5/Qwen3), llama3_json, mistral ([TOOL_CALLS]), openai (gpt-oss's harmony "
        "commentary to=functions.NAME); auto: from the chat template",
        choices=("auto", "hermes", "llama3_json", "mistral", "openai"))
    exclude_tools_when_tool_choice_none: bool = _knob(
        False, "tool_choice none: leave the tools out of the chat template (default: they reach it, as OpenAI's "
        "and vLLM's, and no calls are read out of the text)", negatable=False)
    limits: RequestLimits = field(default_factory=RequestLimits)
    batch: BatchApiConfig = field(default_factory=BatchApiConfig)

    def model_name(self, model: str | None) -> str:
        """The served model name: the flag, else the model argument, else the built-in model's."""
        return self.served_model_name or model or BUILTIN_MODEL_NAME

    def validate(self) -> None:
        """Every value a flag could give that the server cannot run with (ValueError naming the flag)."""
        a, lim, b = self.admission, self.limits, self.batch
        at_least = {"engine_restarts": (self.engine_restarts, 0), "shutdown_timeout": (self.shutdown_timeout, 0),
                    "data_parallel_size": (self.data_parallel_size, 1),
                    "max_request_body_bytes": (lim.max_request_body_bytes, 1),
                    "max_sequences_per_request": (lim.max_sequences_per_request, 1),
                    "max_stop_strings": (lim.max_stop_strings, 0), "max_logprobs": (lim.max_logprobs, 0),
                    "batch_concurrency": (b.batch_concurrency, 1)}
        for name, (value, low) in at_least.items():
            if value < low:
                raise ValueError(f"{flag_name(ServerConfig, name)} must be >= {low}, got {value}")
        positive = {"max_waiting_requests": a.max_waiting_requests, "max_waiting_tokens": a.max_waiting_tokens,
                    "request_timeout": self.request_timeout, "max_prompt_chars": lim.max_prompt_chars,
                    "batch_lease_seconds": b.batch_lease_seconds}
        for name, value in positive.items():
            if value is not None and value <= 0:
                raise ValueError(f"{flag_name(ServerConfig, name)} must be positive, got {value}")
        if not 0 <= self.listen.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.listen.port}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``expresslane router``."""

    backend: tuple[str, ...] = _knob(MISSING, "a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each "
                                     "replica)", metavar="URL", repeat=True)
    listen: ListenConfig = field(default_factory=ListenConfig)
    health_interval: float = _knob(1.0, "seconds between polls of each replica's /load; a replica that fails one "
                                   "is out")


@dataclass(frozen=True, slots=True)
class BatchRunConfig:
    """``expresslane batch``: its own flags (it also takes the batch API's, the served model name and the
    engine's)."""

    output: str = _knob(MISSING, "output file: one result a line in input order (OpenAI's output and error lines "
                        "together)", aliases=("-o",))
