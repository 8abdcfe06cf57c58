"""The engine's part of the config tree: every engine knob lives here, nowhere else.

``EngineConfig.from_kwargs(model=..., max_num_seqs=...)`` routes flat keyword
arguments (vLLM's names) to the sub-config that owns them; ``add_cli_args`` turns
the same fields into ``--kebab-case`` flags (flags.py). Values the engine must discover
(``max_model_len`` from the model, ``num_kv_blocks`` from memory) are ``None``
here and filled in with ``dataclasses.replace`` when the engine resolves them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from expresslane.config.flags import _knob, add_args, check_choices, given
from expresslane.contract import LoRARequest
from expresslane.lanes import DEFAULT_LANE_SLO, Lanes
from expresslane.pooling_params import parse_pooler_config, resolve_runner

if TYPE_CHECKING:
    from expresslane.cost_model.base import StepCostModel


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = _knob(None, "model directory (Hugging Face layout); default: the built-in stdlib-llama-9m")
    tokenizer: str | None = _knob(None, "tokenizer directory (default: the model directory)")
    dtype: str = _knob("auto", "weights and activations dtype; auto = the model's dtype on GPU, float32 on CPU",
                       ("auto", "float32", "float16", "bfloat16"))
    max_model_len: int | None = _knob(None, "longest prompt + output in tokens (default: the model's limit)")
    seed: int = _knob(0, "seed of the random sampler for requests without their own seed")
    quantization: str | None = _knob(None, "weight quantization: default the checkpoint's quantization_config; "
                                     "fp8 also quantizes an unquantized checkpoint at load (W8A8)",
                                     (None, "fp8", "awq", "gptq", "compressed-tensors"))
    load_format: str = _knob("auto", "auto: the weights in the model directory; dummy: random weights generated on "
                             "the device, as make-model would write them (benchmarks; a directory made with "
                             "make-model --no-weights)", ("auto", "dummy"))
    generation_config: str = _knob(
        "auto", "sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as "
        "max_tokens) for requests that do not set them: auto = the model's generation_config.json; vllm or none = "
        "none (the API's own defaults); or a directory holding a generation_config.json")
    runner: str = _knob("auto", "generate (sample tokens) or pooling (embeddings: a request's pooled final hidden "
                        "states, /v1/embeddings and LLM.embed); auto = pooling for a *Model architecture or a "
                        "sentence-transformers directory (modules.json), else generate",
                        ("auto", "generate", "pooling"))
    task: str | None = _knob(None, "vLLM's older name for --runner: embed = pooling, generate = generate",
                             (None, "generate", "embed"))
    pooler_config: str | None = _knob(
        None, "pooling: JSON over the model directory's pooler settings, e.g. '{\"pooling_type\": \"MEAN\", "
        "\"normalize\": false}' (pooling_type LAST, MEAN or CLS; default: the sentence-transformers files, else "
        "LAST, normalised)")
    override_pooler_config: str | None = _knob(None, "vLLM's older name for --pooler-config (applied before it)")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = _knob(16, "tokens per KV-cache block")
    gpu_memory_utilization: float = _knob(0.9, "fraction of GPU memory the engine may use (weights, activations, KV)")
    cpu_kv_cache_space_gb: float = _knob(4.0, "KV-cache memory budget on CPU, in GiB")
    num_kv_blocks: int | None = _knob(None, "number of KV-cache blocks (overrides the memory-based size)")
    enable_prefix_caching: bool = _knob(True, "reuse KV blocks of identical prompt prefixes")
    kv_cache_dtype: str = _knob("auto", "KV-cache element type: auto = the model dtype; fp8 (= fp8_e4m3) stores "
                                "e4m3 with a per-layer scale (1.0 unless the checkpoint has k_scale/v_scale): "
                                "twice the tokens of a 16-bit cache", ("auto", "fp8", "fp8_e4m3"))


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = _knob(256, "most requests running at once")
    max_num_batched_tokens: int = _knob(2048, "token budget of one step (prefill chunks + decodes); under "
                                        "deadline the largest step, each sized below it by the SLO")
    scheduling_policy: str = _knob("deadline", "order of requests: deadline (the default: lanes, earliest TTFT "
                                   "deadline first, steps sized by the SLO with the step-cost model, budget shares, "
                                   "interactive preempts batch); fcfs (arrival order, full-budget steps with a fixed "
                                   "prefill cap beside others: long prompts' TTFT first, shorts wait behind "
                                   "them); priority (fcfs by the request's priority, lower first)",
                                   ("fcfs", "priority", "deadline"))
    # a spec string (flag, keyword), parsed once into `Lanes` when the config is built
    lane_slo: Lanes | str = _knob(DEFAULT_LANE_SLO, "lane targets and budget shares, e.g. "
                                  "'interactive:ttft=200ms,tpot=25ms;batch:ttft=30s,share=0.25' (over the defaults)")
    long_prefill_token_threshold: int | None = _knob(
        None, "most prompt tokens one request may take in a step while other requests wait for the budget "
        "(fcfs/priority: leftover budget still goes to it); default: max_num_batched_tokens // 4, and under "
        "deadline the step-cost model's chunk (giving it turns that sizing off); 0 = no cap")
    batching: str = _knob("continuous", "continuous (join and leave every step); static (take up to "
                          "max_batch_size waiting requests, prefill them in one step, run them to completion); "
                          "dynamic (as static, but wait up to batch_timeout_ms for a full batch)",
                          ("continuous", "static", "dynamic"))
    max_batch_size: int = _knob(8, "batch size of the static and dynamic batching modes")
    batch_timeout_ms: float = _knob(50.0, "dynamic batching: longest wait for a full batch")
    # The default comes from the environment so that a test suite can fix it for every engine it
    # starts, servers included (tests/conftest.py); a flag or keyword wins.
    # (in code also a StepCostModel value, used as given: cost_model/registry.py)
    step_cost_model: str | StepCostModel = _knob(
        os.environ.get("EXPRESSLANE_STEP_COST_MODEL", "calibrate"),
        "the step-cost model the deadline policy sizes steps with: calibrate (time steps at start-up, then "
        "refine from the steps run); nominal (fixed, by a step's shape alone: the same decisions on any "
        "machine, for tests); or a JSON file of a fitted model, fixed (its to_dict, as GET /load "
        "publishes it); default: $EXPRESSLANE_STEP_COST_MODEL, else calibrate")
    min_prefill_chunk: int = _knob(16, "deadline: prefill tokens a step may always carry, whatever the step-cost "
                                   "model says (tokens)")
    prefill_stretch: float = _knob(16.0, "deadline: a prompt's TTFT deadline is its lane's target plus this many "
                                   "times its prefill time alone (a factor): short prompts go before long ones "
                                   "that arrived up to this stretch of their work earlier")
    lone_step_share: int = _knob(8, "deadline: with no decode running, a prefill step lasts at most the "
                                 "interactive TTFT target divided by this (a divisor), or twice its cheapest "
                                 "chunk's step where that is longer: what a request arriving meanwhile waits")
    step_hold_margin_ms: float = _knob(2.0, "plan the next step when the one on the GPU is predicted to end "
                                       "within this margin (ms), so a request arriving meanwhile joins it")
    step_hold_host_factor: float = _knob(3.0, "the hold margin is at least this many times the recent time to "
                                         "plan and launch a step (a factor)")
    step_hold_slice_ms: float = _knob(1.0, "a held step() call sleeps at most this long before returning to its "
                                      "caller (ms), which takes in new requests between calls")
    pd_lanes: str = _knob("off", "on: prompt chunks and decode steps planned in two lanes, in flight at once "
                          "(issue #45); on a CUDA GPU (one process, no LoRA) each lane's steps run on their own SMs "
                          "(a driver split, green-context streams, graphs per split), elsewhere the lanes take turns "
                          "on one stream; experimental: short of issue #45's targets so far (docs/performance.md)",
                          ("off", "on"))

    def __post_init__(self) -> None:
        if isinstance(self.lane_slo, str):
            object.__setattr__(self, "lane_slo", Lanes.parse(self.lane_slo))


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: str = _knob("auto", "auto, cpu, cuda or cuda:N")
    attention_backend: str = _knob("auto", "attention implementation: auto = triton on CUDA, torch elsewhere",
                                   ("auto", "torch", "triton"))
    enforce_eager: bool = _knob(False, "never capture CUDA graphs")
    prefill_attention: str = _knob(
        "auto", "who runs prefill attention with the triton backend: triton (our kernel), cudnn (torch's cuDNN "
        "attention for every prefill chunk of 512+ tokens, in eager steps) or auto (cuDNN for a chunk of 1024+ "
        "tokens over 4096+ keys, on Hopper; our kernel for the rest; docs/architecture.md, \"Library prefill\")",
        ("triton", "cudnn", "auto"))
    fused_decode_layer: bool = _knob(
        False, "decode steps of at most 16 tokens run each dense layer in 6 launches: RMSNorm folded into the QKV "
        "and gate|up GEMVs (the norm weights multiplied into those weights at load), SiLU-and-mul into down's, the "
        "residual adds into o_proj's and down's, decode attention's splits combined by its own kernel; only for "
        "the triton backend on CUDA with bf16/fp16, unquantized, dense, tensor_parallel_size 1 (else logged, off)")
    max_mixed_graph_tokens: int = _knob(2048, "steps of up to this many tokens (and max_num_batched_tokens) "
                                        "replay a captured CUDA graph: a step of a few hundred tokens is otherwise "
                                        "bound by kernel launches (tokens)")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = _knob(1, "split every layer over this many ranks (GPUs; CPU processes over gloo)")
    nnodes: int = _knob(1, "nodes the tensor-parallel ranks span (tensor_parallel_size / nnodes ranks on each)")
    node_rank: int = _knob(0, "this node's index; node 0 schedules and serves HTTP, the others run workers")
    dist_init_addr: str | None = _knob(None, "host:port of node 0 where the ranks meet (needed when nnodes > 1; "
                                       "default: a free 127.0.0.1 port)")
    enable_expert_parallel: bool = _knob(False, "mixture-of-experts models: spread whole experts over the "
                                         "tensor-parallel ranks (tokens travel to them by all-to-all) instead of "
                                         "splitting every expert's weights")
    expert_load_interval: int = _knob(64, "MoE models: steps between copies of the per-expert token counters "
                                      "to the host (none waits for its copy)")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    speculative_method: str | None = _knob(
        None, "speculative decoding: ngram (proposals from the request's own prompt and output) or draft_model "
        "(a smaller model, --speculative-model); default: draft_model when --speculative-model is given, else off",
        (None, "ngram", "draft_model"))
    speculative_model: str | None = _knob(None, "draft model directory (same tokenizer as the model), e.g. the "
                                          "built-in expresslane/models/data/stdlib-llama-2m-draft")
    num_speculative_tokens: int = _knob(4, "tokens proposed per decoding request and step (verified in one "
                                        "target step)")
    prompt_lookup_max: int = _knob(4, "ngram: longest suffix looked up in the request's tokens")
    prompt_lookup_min: int = _knob(2, "ngram: shortest suffix looked up")
    speculative_disable_by_batch_size: int | None = _knob(
        None, "speculate only while at most this many requests decode; default: whenever the step-cost model "
        "predicts less time per generated token (off at high batch)")
    # how the step-cost model's decision to speculate is made and measured (none of these change tokens)
    speculative_prior_acceptance: float = _knob(
        0.5, "acceptance rate (accepted over proposed tokens, 0..1) assumed until the engine has measured its own")
    speculative_prior_until: int = _knob(
        64, "proposed tokens (verified or shadowed) after which the measured acceptance rate replaces the prior")
    speculative_probe_every: int = _knob(
        8, "draft_model, while on the prior: one planned step in this many speculates to measure acceptance "
        "(else a prior that says no would hold for good)")
    speculative_probe_every_measured: int = _knob(
        64, "draft_model, past the prior: one planned step in this many speculates where full acceptance "
        "would pay (a rate measured on a few verifies is not final)")
    speculative_gain_margin: float = _knob(
        0.9, "speculate only when the predicted time per generated token is below this fraction of plain "
        "decoding's")
    speculative_warmup_verifies: int = _knob(
        4, "verify steps of each batch-size bucket whose times are ignored (first-use costs of the verify "
        "shapes' kernels)")
    speculative_verify_window: int = _knob(
        16, "verify steps of each batch-size bucket whose median measured over predicted time scales the "
        "prediction of the next")

    @property
    def method(self) -> str | None:
        return self.speculative_method or ("draft_model" if self.speculative_model else None)


@dataclass(frozen=True, slots=True)
class StructuredOutputConfig:
    grammar_compile_timeout_s: float = _knob(10.0, "a grammar not compiled within this many seconds rejects its "
                                             "request (the compile thread runs on)")
    grammar_compile_threads: int = _knob(2, "threads compiling grammars off the step loop")
    grammar_cache_size: int = _knob(512, "compiled grammars kept, least recently used out first (entries)")
    json_close_share: int = _knob(4, "a JSON sequence is steered to close its value in the last 1/this of its "
                                  "token budget (a divisor; at least json_close_tokens)")
    json_close_tokens: int = _knob(32, "a JSON sequence is steered to close its value once this many tokens of "
                                   "its budget are left, or fewer (tokens)")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    enable_lora: bool = _knob(False, "serve LoRA adapters (PEFT directories) beside the base model: a request "
                              "picks one by its model name (server) or lora_request (offline)")
    lora_modules: tuple[str, ...] = _knob((), "adapters served from start, as name=path (PEFT adapter "
                                          "directories) or JSON {\"name\": ..., \"path\": ...}; needs enable_lora",
                                          nargs="+")
    max_loras: int = _knob(1, "adapters one step may use (their weights' slots on the device)")
    max_lora_rank: int = _knob(16, "largest adapter rank accepted (every slot is sized for it)")
    max_cpu_loras: int | None = _knob(None, "adapters kept in host memory, least recently used out first "
                                      "(re-read from their directory when needed again); default: max_loras")

    @property
    def cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def startup_loras(self) -> list[LoRARequest]:
        """`lora_modules` as adapters with ids 1, 2, ... in the order given (the API process and
        the engine number them alike; adapters loaded later get the next ids)."""
        return [LoRARequest(name, i, path) for i, (name, path) in
                enumerate(parse_lora_modules(self.lora_modules).items(), 1)]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    TITLE: ClassVar[str] = "engine"

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        parts: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(cls)}
        owner = _field_owners()
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unknown engine config field {key!r}; known: {', '.join(sorted(owner))}")
            parts[owner[key]][key] = value
        config = cls(**{name: _SECTIONS[name](**values) for name, values in parts.items()})
        config.validate()
        return config

    def validate(self) -> None:
        s, c, m, so = self.scheduler, self.cache, self.model, self.structured_output
        if m.generation_config not in ("auto", "vllm", "none") and not Path(m.generation_config,
                                                                             "generation_config.json").is_file():
            raise ValueError(f"generation_config must be auto, vllm, none or a directory holding a "
                             f"generation_config.json, got {m.generation_config!r}")
        for name, value in (("max_num_seqs", s.max_num_seqs), ("max_num_batched_tokens", s.max_num_batched_tokens),
                            ("block_size", c.block_size), ("max_batch_size", s.max_batch_size),
                            ("min_prefill_chunk", s.min_prefill_chunk), ("lone_step_share", s.lone_step_share),
                            ("max_mixed_graph_tokens", self.device.max_mixed_graph_tokens),
                            ("expert_load_interval", self.parallel.expert_load_interval),
                            ("grammar_compile_threads", so.grammar_compile_threads),
                            ("grammar_cache_size", so.grammar_cache_size), ("json_close_share", so.json_close_share)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (("prefill_stretch", s.prefill_stretch), ("step_hold_margin_ms", s.step_hold_margin_ms),
                            ("step_hold_host_factor", s.step_hold_host_factor),
                            ("step_hold_slice_ms", s.step_hold_slice_ms), ("json_close_tokens", so.json_close_tokens),
                            ("grammar_compile_timeout_s", so.grammar_compile_timeout_s)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if c.num_kv_blocks is not None and c.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {c.num_kv_blocks}")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.long_prefill_token_threshold is not None and s.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {s.long_prefill_token_threshold}")
        if s.pd_lanes == "on" and (s.batching != "continuous" or self.speculative.method is not None):
            raise ValueError("pd_lanes on: needs continuous batching and no speculative decoding")
        if s.batch_timeout_ms < 0:
            raise ValueError(f"batch_timeout_ms must be >= 0, got {s.batch_timeout_ms}")
        if m.max_model_len is not None and m.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {m.max_model_len}")
        p = self.parallel
        if not isinstance(p.tensor_parallel_size, int) or p.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {p.tensor_parallel_size!r}")
        if p.nnodes < 1 or p.tensor_parallel_size % p.nnodes:
            raise ValueError(f"nnodes must be >= 1 and divide tensor_parallel_size ({p.tensor_parallel_size}), "
                             f"got {p.nnodes}")
        if not 0 <= p.node_rank < p.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={p.nnodes}), got {p.node_rank}")
        if p.nnodes > 1 and not p.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is needed when nnodes > 1")
        if p.dist_init_addr is not None and not re.fullmatch(r"[^:\s]+:\d{1,5}", p.dist_init_addr):
            raise ValueError(f"dist_init_addr must be host:port, got {p.dist_init_addr!r}")
        sd = self.speculative
        if sd.method == "draft_model" and not sd.speculative_model:
            raise ValueError("speculative_method draft_model needs speculative_model (a draft model directory)")
        if sd.method is not None and (not isinstance(sd.num_speculative_tokens, int) or
                                      not 1 <= sd.num_speculative_tokens <= 16):
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {sd.num_speculative_tokens!r}")
        if not 1 <= sd.prompt_lookup_min <= sd.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {sd.prompt_lookup_min} and "
                             f"{sd.prompt_lookup_max}")
        if sd.method is not None and p.tensor_parallel_size > 1:
            raise ValueError("speculative decoding runs with tensor_parallel_size 1 only (for now)")
        if sd.speculative_disable_by_batch_size is not None and sd.speculative_disable_by_batch_size < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be positive, got "
                             f"{sd.speculative_disable_by_batch_size}")
        if m.task is not None or m.runner != "auto":
            resolve_runner(m.runner, m.task, [], ".")  # a bad pair named now; auto is resolved with the model
        for text, name in ((m.override_pooler_config, "override_pooler_config"), (m.pooler_config, "pooler_config")):
            parse_pooler_config(text, name)
        self._validate_lora()
        for section in (m, c, s, self.device, p, sd, self.structured_output):
            check_choices(section)

    def _validate_lora(self) -> None:
        lo = self.lora
        for name, value in (("max_loras", lo.max_loras), ("max_lora_rank", lo.max_lora_rank),
                            ("max_cpu_loras", lo.cpu_loras)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if lo.cpu_loras < lo.max_loras:
            raise ValueError(f"max_cpu_loras ({lo.cpu_loras}) must be at least max_loras ({lo.max_loras})")
        if lo.lora_modules and not lo.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        parse_lora_modules(lo.lora_modules)
        if not lo.enable_lora:
            return
        if self.speculative.method is not None:
            raise ValueError("enable_lora is not combined with speculative decoding (for now)")
        if self.device.fused_decode_layer:
            raise ValueError("enable_lora is not combined with fused_decode_layer (for now)")

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """A copy with some flat fields changed (used when resolving discovered values)."""
        owner = _field_owners()
        changes: dict[str, dict[str, Any]] = {}
        for key, value in kwargs.items():
            changes.setdefault(owner[key], {})[key] = value
        return dataclasses.replace(
            self, **{name: dataclasses.replace(getattr(self, name), **vals) for name, vals in changes.items()})


_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "device": DeviceConfig,
             "parallel": ParallelConfig, "speculative": SpeculativeConfig,
             "structured_output": StructuredOutputConfig, "lora": LoRAConfig}


def parse_lora_modules(modules: tuple[str, ...]) -> dict[str, str]:
    """``name=path`` entries (``--lora-modules``), or vLLM's JSON form ``{"name": ..., "path": ...}``,
    as {name: path}; names are unique."""
    out: dict[str, str] = {}
    for entry in modules:
        name, sep, path = entry.partition("=")
        if entry.lstrip().startswith("{"):
            try:
                spec = json.loads(entry)
                name, path, sep = spec["name"], spec["path"], "="
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"lora_modules: expected a JSON object with name and path, got {entry!r}") from None
        if not sep or not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path, got {entry!r}")
        if name.strip() in out:
            raise ValueError(f"lora_modules: the name {name.strip()!r} is given twice")
        out[name.strip()] = path.strip()
    return out


def _field_owners() -> dict[str, str]:
    return {f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """One ``--flag`` per engine knob, in the "engine" help group (the model is a positional)."""
    add_args(parser, EngineConfig, skip=skip)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine knobs the user gave, flat (``EngineConfig.from_kwargs``'s form), with the
    positional model where the command has one."""
    return {**given(EngineConfig, args), **({"model": args.model} if hasattr(args, "model") else {})}
