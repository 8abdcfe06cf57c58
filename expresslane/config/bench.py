"""The bench's part of the config tree: one section per ``expresslane bench`` subcommand, and
the client options every ``--base-url`` subcommand shares. These are the configs the benchmarks
run with (``run_serving(ServingConfig(...))``); their flags are made from them (flags.py).

Values a flag gives as text (``--slo``, ``--goodput``, ``--mix``, headers, ``--extra-body``) stay
text here and are parsed where they are used, in the bench modules, so this module stays plain
data. Fields that are not knobs (``model`` positionals, ``engine_args``, an ``http`` client) are
filled by the command.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

from expresslane.config.flags import _knob, check_choices

# The one name of each in-process batching mode (bench/inprocess.py maps them to engine settings).
MODE_NAMES = ("static", "dynamic", "continuous", "continuous-lanes")
SCENARIO_NAMES = ("isolated", "beside-long", "mixed", "goodput")
DEFAULT_SLO = "mean_ttft_ms:500,p99_ttft_ms:2000,p99_tpot_ms:100,failure_rate:0.01"
_SLO_HELP = ("targets; *_ms keys and failure_rate are upper bounds, throughputs (requests_per_min, "
             "request_throughput, output_throughput) lower bounds")
_NO_TQDM = "no progress bar"


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    TITLE: ClassVar[str] = "sampling (sent in every request)"

    temperature: float = _knob(0.0, "0 is greedy")
    top_p: float | None = _knob(None, "not sent unless given")
    top_k: int | None = _knob(None, "not sent unless given")
    min_p: float | None = _knob(None, "not sent unless given")


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How to reach and query the server: the flags every ``--base-url`` subcommand shares."""

    TITLE: ClassVar[str] = "server (OpenAI-compatible)"

    base_url: str | None = _knob(None, "server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)")
    model: str | None = _knob(None, "model name to request (default: the first of GET /v1/models)")
    endpoint: str = _knob("completions", "/v1/completions or /v1/chat/completions", ("completions", "chat"))
    api_key: str | None = _knob(None, "sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY if set)")
    header: tuple[str, ...] = _knob((), "extra HTTP header (repeatable)", metavar="NAME:VALUE", repeat=True)
    extra_body: str | None = _knob(None, "JSON object merged into every request body, last", metavar="JSON")
    tokenizer: str | None = _knob(None, "local tokenizer for exact prompt lengths (default: the server's /tokenize "
                                  "and /detokenize; without either, lengths are estimates)", metavar="DIR")
    ignore_eos: bool = _knob(False, "send ignore_eos=true so every request generates all its tokens",
                             negatable=False)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str = _knob("random", "random | sharegpt-like | mixed | prefix-repetition | FILE.jsonl (prompt, "
                      "output_len, lane, priority)", flag="dataset")
    num_prompts: int | None = _knob(None, "default 1000, or every line of FILE.jsonl")
    input_len: int = _knob(1024, "prompt tokens (of the short ones if mixed)")
    output_len: int = _knob(128, "max_tokens per request")
    range_ratio: float = _knob(0.0, "lengths uniform in len*(1-r)..len*(1+r)")
    long_fraction: float = _knob(0.2, "mixed: share of long prompts")
    long_input_len: int = _knob(4096, "mixed: long prompt tokens")
    long_threshold: int = _knob(1024, "prompts longer than this count as class 'long'")
    class_lanes: bool = _knob(False, "send lane=interactive for short prompts and lane=batch for long",
                              negatable=False)
    prefix_len: int = _knob(256, "prefix-repetition: the first tokens of each prompt, shared with others")
    num_prefixes: int = _knob(10, "prefix-repetition: distinct shared prefixes (requests take them in turn)")
    seed: int = _knob(0, "seed of the lengths and prompts")


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """``bench serving``: open-loop load (``--goodput`` and ``--slo`` are parsed by the run)."""

    client: ClientOptions = field(default_factory=ClientOptions)
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    request_rate: float = _knob(math.inf, "requests/s (gamma arrivals); inf sends all at once")
    burstiness: float = _knob(1.0, "gamma shape of arrivals: 1 Poisson, <1 burstier, >1 more regular")
    max_concurrency: int | None = _knob(None, "at most this many requests in flight", flag="concurrency",
                                        aliases=("--max-concurrency",))
    warmup: int = _knob(0, "untimed requests sent first")
    alone_probes: int = _knob(3, "short requests sent one at a time to measure TTFT alone (0: skip)")
    goodput: tuple[str, ...] | None = _knob(None, "per-request targets ttft:MS,tpot:MS,e2el:MS for "
                                            "request_goodput", metavar="METRIC:MS", nargs="+")
    slo: str = _knob(DEFAULT_SLO, _SLO_HELP, metavar="METRIC:VALUE,...")
    disable_tqdm: bool = _knob(False, _NO_TQDM, negatable=False)


@dataclass(frozen=True, slots=True)
class SaturationRule:
    min_gain: float = _knob(0.10, "sweep: past saturation when throughput grows less than this",
                            flag="saturation-min-gain")
    latency_factor: float = _knob(5.0, "sweep: past saturation when P99 E2E exceeds this x the lightest load's",
                                  flag="saturation-latency-factor")
    max_failure_rate: float = _knob(0.05, "sweep: past saturation when more than this fraction fails",
                                    flag="saturation-max-failures")


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """``bench serving``'s sweep: one of the two lists, and when to stop."""

    rates: tuple[float, ...] | None = _knob(None, "run once per request rate, stopping past saturation",
                                            flag="sweep-rates", metavar="R1,R2,...", exclusive="sweep")
    concurrency: tuple[int, ...] | None = _knob(None, "run once per concurrency, stopping past saturation",
                                                flag="sweep-concurrency", metavar="C1,C2,...", exclusive="sweep")
    rule: SaturationRule = field(default_factory=SaturationRule)


@dataclass(frozen=True, slots=True)
class TrafficConfig:
    """``bench traffic``: closed-loop users (``--mix`` and ``--slo`` are parsed by the run)."""

    client: ClientOptions = field(default_factory=ClientOptions)
    num_users: int = _knob(10, "simulated users")
    duration: float = _knob(60.0, "seconds users keep sending")
    think_time: float = _knob(1.0, "mean seconds a user thinks between reply and next request")
    mix: str = _knob("interactive:1", "lanes of users with weights, e.g. interactive:0.8,batch:0.2")
    input_len: int = _knob(256, "prompt tokens")
    output_len: int = _knob(128, "max_tokens per request")
    batch_input_len: int = _knob(2048, "lane 'batch' prompt tokens")
    batch_output_len: int = _knob(512, "lane 'batch' max_tokens")
    range_ratio: float = _knob(0.0, "lengths uniform in len*(1-r)..len*(1+r)")
    long_threshold: int = _knob(1024, "prompts longer than this count as class 'long'")
    seed: int = _knob(0, "seed of the lengths and prompts")
    slo: str = _knob(DEFAULT_SLO, _SLO_HELP, metavar="METRIC:VALUE,...")
    disable_tqdm: bool = _knob(False, _NO_TQDM, negatable=False)


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    """``bench scenarios`` (and, with its own ``duration``, ``bench doctor``)."""

    client: ClientOptions = field(default_factory=ClientOptions)
    run: tuple[str, ...] = _knob(SCENARIO_NAMES, f"which scenarios: {', '.join(SCENARIO_NAMES)}",
                                 metavar="S1,S2,...")
    short_len: int = _knob(64, "tokens of a short prompt")
    long_len: int = _knob(8192, "tokens of a long prompt (cut to the server's context)")
    output_len: int = _knob(64, "tokens generated per request")
    num_short: int = _knob(16, "short prompts sent beside the long one")
    lead_ms: float = _knob(5.0, "the shorts leave this long after the long one")
    repeats: int = _knob(3, "runs of the burst and isolated scenarios")
    rate: float = _knob(8.0, "mixed: requests/s (Poisson)")
    duration: float = _knob(20.0, "mixed: seconds of arrivals")
    long_fraction: float = _knob(0.15, "mixed and goodput: share of long prompts")
    rates: tuple[float, ...] = _knob((8.0, 16.0, 24.0, 32.0), "goodput: offered rates", metavar="R1,R2,...")
    sweep_duration: float = _knob(15.0, "goodput: seconds per rate")
    isolated_lens: tuple[int, ...] = _knob((128, 2048, 8192), "isolated: prompt lengths (cut to the server's "
                                           "context)", metavar="N1,N2,...")
    long_lane: str | None = _knob(None, "send long prompts in this lane (expresslane's lanes; others ignore it)",
                                  ("interactive", "batch"))
    slo: tuple[float, ...] = _knob((100.0, 25.0, 1000.0), "goodput SLO in ms",
                                   metavar="SHORT_TTFT,SHORT_TPOT,LONG_TTFT")
    seed: int = _knob(0, "seed of the prompts")

    def settings(self) -> dict:
        """How it ran, for the result (the client aside; the SLO by name)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("client", "slo")}
        return {**out, "short_ttft_ms": self.short_ttft_ms, "short_tpot_ms": self.short_tpot_ms,
                "long_ttft_ms": self.long_ttft_ms}

    @property
    def short_ttft_ms(self) -> float:
        return self.slo[0]

    @property
    def short_tpot_ms(self) -> float:
        return self.slo[1]

    @property
    def long_ttft_ms(self) -> float:
        return self.slo[2]

    def validate(self) -> None:
        if unknown := [s for s in self.run if s not in SCENARIO_NAMES]:
            raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIO_NAMES)}")
        for name in ("short_len", "long_len", "output_len", "num_short", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_len < 2:
            raise ValueError("output_len must be >= 2: ITL and TPOT need two tokens")
        if min(self.rates, default=1) <= 0 or self.rate <= 0 or self.duration <= 0 or self.sweep_duration <= 0:
            raise ValueError("rates and durations must be positive")
        if len(self.slo) != 3:
            raise ValueError(f"--slo takes three numbers (short TTFT, short TPOT, long TTFT in ms), got "
                             f"{','.join(map(str, self.slo))!r}")


@dataclass(frozen=True, slots=True)
class DoctorScenarioConfig(ScenarioConfig):
    """``bench doctor``'s scenarios: a shorter mixed load (it runs isolated, beside-long and mixed)."""

    duration: float = _knob(10.0, "mixed: seconds of arrivals")


@dataclass(frozen=True, slots=True)
class OverheadConfig:
    """``bench server-overhead``."""

    client: ClientOptions = field(default_factory=ClientOptions)
    sequential: int = _knob(200, "requests sent one at a time")
    concurrency: int = _knob(64, "closed-loop streams, then")
    rounds: int = _knob(4, "requests per stream, one after another")
    warmup: int = _knob(10, "untimed requests first")
    prompt_len: int = _knob(16, "prompt tokens of every request")
    seed: int = _knob(0, "seed of the prompts")
    disable_tqdm: bool = _knob(False, _NO_TQDM, negatable=False)


@dataclass(frozen=True, slots=True)
class FlatLatencyConfig:
    """``bench flat-latency``: in-process (``model``, ``engine_args``), or against ``http``."""

    model: str | None = None  # in-process: the model directory (over HTTP: http.model); a positional
    http: ClientOptions | None = None  # run against this server instead of in-process
    input_lens: tuple[int, ...] = _knob((8, 64, 512, 1536), "(a) prompt lengths sent alone, capped by the "
                                        "model's context", metavar="N1,N2,...")
    num_short: int = _knob(8, "(b) short prompts sent together")
    short_len: int = _knob(16, "(b) tokens of a short prompt")
    long_len: int = _knob(1536, "(b) tokens of the long prompt, sent first")
    output_len: int = _knob(4, "tokens generated per request (EOS ignored)")
    repeats: int = _knob(3, "runs of each scenario; TTFTs are medians")
    modes: tuple[str, ...] = _knob(MODE_NAMES, "in-process rows, each a fresh engine: static, dynamic, continuous "
                                   "(fcfs), continuous-lanes (deadline policy; the long prompt in the batch lane)",
                                   metavar="M1,M2,...")
    baseline: str | None = _knob(None, "add a row of transformers generate (one left-padded static batch) on the "
                                 "same prompts", ("hf",))
    engine_args: dict = field(default_factory=dict)  # the engine flags the user gave
    disable_tqdm: bool = _knob(False, _NO_TQDM, negatable=False)

    def validate(self) -> None:
        for name in ("num_short", "short_len", "long_len", "output_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.input_lens or min(self.input_lens) < 1:
            raise ValueError(f"input lengths must be >= 1, got {list(self.input_lens)}")
        if unknown := [m for m in self.modes if m not in MODE_NAMES]:
            raise ValueError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODE_NAMES)}")
        check_choices(self)
        if self.http is None and not self.modes:
            raise ValueError("no mode to run")
        if self.http is not None and (self.engine_args or self.baseline):
            raise ValueError("engine flags and --baseline apply to in-process runs; the server at "
                             "--base-url has its own settings")


@dataclass(frozen=True, slots=True)
class OneBatchConfig:
    """``bench one-batch``. A quantized run (weights or ``--kv-cache-dtype fp8``) also reports its
    accuracy against the unquantized model (expresslane.bench.accuracy)."""

    model: str | None = None  # a positional
    batch_size: int = _knob(8, "requests in the batch")
    input_len: int = _knob(32, "prompt tokens (random ids)")
    output_len: int = _knob(128, "tokens generated per request (EOS ignored)")
    quantization: str = _knob(
        "none", "weight quantization of the timed engine; a quantized run (or --kv-cache-dtype fp8) also reports "
        "accuracy against the unquantized model: teacher-forced top-1 agreement, mean KL, perplexity difference, "
        "with standard errors", ("none", "fp8", "awq", "gptq", "compressed-tensors"))
    peak_bandwidth: float | None = _knob(None, "GPU memory bandwidth in B/s for the floor (default 4.27e12: one "
                                         "H200's measured device copy)")
    engine_args: dict = field(default_factory=dict)  # dtype, device, ... (the engine flags the user gave)
    baseline_model: str | None = _knob(None, "the unquantized model for the accuracy report (default: MODEL "
                                       "without quantization)")
    accuracy_trials: int = _knob(3, "repeated accuracy runs (fresh texts each)")
    accuracy_texts: int = _knob(8, "texts per accuracy trial")
    accuracy_text_len: int = _knob(256, "tokens per accuracy text")
    accuracy_chart: str | None = _knob(None, "write a PNG: per-text accuracy before/after, standard error vs "
                                       "number of trials")

    def validate(self) -> None:
        for name in ("batch_size", "input_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.output_len < 2:
            raise ValueError(f"output_len must be >= 2 (one prefill step, then decode steps), got {self.output_len}")
        check_choices(self)
        if self.accuracy_trials < 1:
            raise ValueError(f"accuracy_trials must be >= 1, got {self.accuracy_trials}")
        if self.peak_bandwidth is not None and self.peak_bandwidth <= 0:
            raise ValueError(f"peak bandwidth must be positive, got {self.peak_bandwidth}")


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """``bench throughput``: expresslane against transformers generate, in-process."""

    model: str | None = None  # a positional
    num_prompts: int = _knob(64, "prompts, all submitted at once")
    input_len: int = _knob(128, "prompt tokens (random ids)")
    output_len: int = _knob(64, "tokens generated per prompt")
    hf_batch_size: int = _knob(64, "transformers' static batch size")
    no_baseline: bool = _knob(False, "expresslane only (no transformers run)", negatable=False)
    engine_args: dict = field(default_factory=dict)  # the engine flags the user gave

    def validate(self) -> None:
        for name in ("num_prompts", "input_len", "output_len", "hf_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ResultOutput:
    """Where a bench writes its result."""

    output: str | None = _knob(None, "write the result JSON here")


@dataclass(frozen=True, slots=True)
class ChartOutput:
    chart: str | None = _knob(None, "write a PNG chart here")


@dataclass(frozen=True, slots=True)
class ReportConfig:
    """``bench report`` (its result files are a positional)."""

    output: str = _knob(MISSING, "report.html or chart.png")
    compare: bool = _knob(False, "add a side-by-side table, as ratios to the first result", negatable=False)
    labels: str | None = _knob(None, "comma-separated names for the results")
