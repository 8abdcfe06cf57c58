"""``expresslane bench serving|traffic|report|one-batch|flat-latency|scenarios|doctor|throughput|
server-overhead``: the argparse front of the bench suite.

Every flag is made from the config tree (``expresslane/config/bench.py``; engine flags from
``config/engine.py``), which holds its default and help; the only hand-written arguments are
the positionals (``model``, ``report``'s result files). Flag names follow ``vllm bench serve``
where one exists; the in-process benchmarks (one-batch, flat-latency, throughput) also take every
engine flag (``--dtype``, ``--device``, ``--max-num-batched-tokens``...) except the ones they set
themselves. The handlers are in ``commands.py``; they import the heavy modules (torch, aiohttp,
matplotlib) when they run, so ``expresslane --help`` stays fast.
"""

from __future__ import annotations

import argparse

from expresslane.bench.commands import (flat_latency_command, one_batch_command, overhead_command, report_command,
                                        scenarios_command, serving_command, throughput_command, traffic_command)
from expresslane.config import add_cli_args
from expresslane.config.bench import (ChartOutput, ClientOptions, DoctorScenarioConfig, FlatLatencyConfig,
                                      OneBatchConfig, OverheadConfig, ReportConfig, ResultOutput, ScenarioConfig,
                                      ServingConfig, SweepConfig, ThroughputConfig, TrafficConfig)
from expresslane.config.flags import add_args

_MODEL_HELP = "model directory (default: the built-in stdlib-llama-9m)"


def add_model_arg(p: argparse.ArgumentParser, help: str = _MODEL_HELP) -> None:
    """The positional model (hand-written: positionals are not knobs)."""
    p.add_argument("model", nargs="?", default=None, help=help)


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark and diagnose any OpenAI-compatible server, or the engine in-process")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    # The client's knobs are nested in each HTTP section (ServingConfig.client, ...): --base-url is
    # required there, optional for flat-latency (without it the run is in-process).
    p = sub.add_parser("serving", help="open-loop serving benchmark (vllm bench serve style)")
    add_args(p, ServingConfig, required=("base_url",))
    add_args(p, SweepConfig)
    add_args(p, ResultOutput)
    p.set_defaults(func=serving_command)

    p = sub.add_parser("traffic", help="closed-loop simulated users with a time series")
    add_args(p, TrafficConfig, required=("base_url",))
    add_args(p, ResultOutput)
    p.set_defaults(func=traffic_command)

    p = sub.add_parser("report", help="HTML page or PNG of charts from result JSON files")
    p.add_argument("results", nargs="+", metavar="RESULT", help="result JSON files")  # a positional
    add_args(p, ReportConfig)
    p.set_defaults(func=report_command)

    p = sub.add_parser("one-batch", help="one static batch in-process: prefill and decode step latency, bandwidth "
                                         "against the floor")
    add_model_arg(p)
    add_args(p, OneBatchConfig)
    add_args(p, ResultOutput)
    add_cli_args(p, skip=("model", "batching", "max_batch_size", "scheduling_policy", "quantization"))
    p.set_defaults(func=one_batch_command)

    p = sub.add_parser("flat-latency", help="does a short request wait for a long one? TTFT alone and mixed, per "
                                            "batching mode, in-process or against a server")
    add_model_arg(p, "model directory (default: the built-in stdlib-llama-9m); with --base-url, the model name to "
                     "request (default: the first of GET /v1/models)")
    add_args(p, ClientOptions, skip=("model",), help={"base_url": "server root, e.g. http://127.0.0.1:8000; "
                                                                   "without it, the run is in-process"})
    add_args(p, FlatLatencyConfig)
    add_args(p, ResultOutput)
    add_cli_args(p, skip=("model", "batching", "scheduling_policy", "tokenizer"))
    p.set_defaults(func=flat_latency_command)

    for name, section, help_text in (
            ("scenarios", ScenarioConfig, "flat-latency scenarios against a server: shorts beside a long prompt, "
                                          "Poisson mixed load, goodput sweep, isolated TTFT"),
            ("doctor", DoctorScenarioConfig, "is the server flat? names the cause and prints the flags, with values, "
                                             "that address it (expresslane, vLLM or SGLang names)")):
        p = sub.add_parser(name, help=help_text)
        add_args(p, section, required=("base_url",), skip=("run",) if name == "doctor" else ())
        add_args(p, ChartOutput)
        add_args(p, ResultOutput)
        p.set_defaults(func=scenarios_command, bench_section=section)

    p = sub.add_parser("throughput", help="offline generation throughput in-process, against transformers generate "
                                          "on the same prompts")
    add_model_arg(p)
    add_args(p, ThroughputConfig)
    add_args(p, ResultOutput)
    add_cli_args(p)
    p.set_defaults(func=throughput_command)

    p = sub.add_parser("server-overhead", help="TTFT through HTTP minus the engine's own TTFT (an expresslane "
                                               "server's return_metrics)")
    add_args(p, OverheadConfig, required=("base_url",))
    add_args(p, ResultOutput)
    p.set_defaults(func=overhead_command)
