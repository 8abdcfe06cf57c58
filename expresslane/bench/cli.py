"""``expresslane bench serving|traffic|report|one-batch|flat-latency|throughput|server-overhead``:
argparse front of the bench suite.

Flag names follow ``vllm bench serve`` where one exists; the in-process benchmarks
(one-batch, flat-latency) also take every engine flag (``--dtype``, ``--device``,
``--max-num-batched-tokens``...) except the ones they set themselves. The handlers are in
``commands.py``; they import the heavy modules (torch, aiohttp, matplotlib) when they run,
so ``expresslane --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math

from expresslane.bench.commands import (client_options, fail, flat_latency_command, one_batch_command,
                                        overhead_command, report_command, serving_command,
                                        throughput_command, traffic_command)
from expresslane.bench.slo import DEFAULT_SLO
from expresslane.config import add_cli_args


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


MODE_NAMES = ("static", "dynamic", "continuous", "continuous-lanes")  # = inprocess.MODES (tested)


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark and diagnose any OpenAI-compatible server, or the engine "
                      "in-process")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serving_parser(sub)
    add_traffic_parser(sub)
    add_report_parser(sub)
    add_one_batch_parser(sub)
    add_flat_latency_parser(sub)
    add_scenario_parsers(sub)
    add_throughput_parser(sub)
    add_overhead_parser(sub)


def add_client_args(p: argparse.ArgumentParser, base_url_required: bool = True) -> None:
    """How to reach and query the server: shared by every ``--base-url`` subcommand."""
    g = p.add_argument_group("server (OpenAI-compatible)")
    g.add_argument("--base-url", required=base_url_required,
                   help="server root, e.g. http://127.0.0.1:8000"
                        + ("" if base_url_required else "; without it, the run is in-process"))
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    g.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY if set)")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                   help="extra HTTP header (repeatable)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body, last")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="local tokenizer for exact prompt lengths (default: the server's /tokenize "
                        "and /detokenize; without either, lengths are estimates)")
    s = p.add_argument_group("sampling (sent in every request)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=None, help="not sent unless given")
    s.add_argument("--top-k", type=int, default=None, help="not sent unless given")
    s.add_argument("--min-p", type=float, default=None, help="not sent unless given")
    s.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos=true so every request generates all its tokens")


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_client_args(p)
    p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and prompts")
    p.add_argument("--slo", default=DEFAULT_SLO, metavar="METRIC:VALUE,...",
                   help="targets; *_ms keys and failure_rate are upper bounds, throughputs "
                        "(requests_per_min, request_throughput, output_throughput) lower bounds")
    p.add_argument("--output", help="write the result JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serving_parser(sub) -> None:
    p = sub.add_parser("serving", help="open-loop serving benchmark (vllm bench serve style)")
    add_server_args(p)
    p.add_argument("--dataset", default="random",
                   help="random | sharegpt-like | mixed | prefix-repetition | FILE.jsonl (prompt, "
                        "output_len, lane, priority)")
    p.add_argument("--num-prompts", type=int, help="default 1000, or every line of FILE.jsonl")
    p.add_argument("--input-len", type=int, default=1024,
                   help="prompt tokens (of the short ones if mixed)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1-r)..len*(1+r)")
    p.add_argument("--long-fraction", type=float, default=0.2, help="mixed: share of long prompts")
    p.add_argument("--long-input-len", type=int, default=4096, help="mixed: long prompt tokens")
    p.add_argument("--long-threshold", type=int, default=1024,
                   help="prompts longer than this count as class 'long'")
    p.add_argument("--prefix-len", type=int, default=256,
                   help="prefix-repetition: the first tokens of each prompt, shared with others")
    p.add_argument("--num-prefixes", type=int, default=10,
                   help="prefix-repetition: distinct shared prefixes (requests take them in turn)")
    p.add_argument("--class-lanes", action="store_true",
                   help="send lane=interactive for short prompts and lane=batch for long")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (gamma arrivals); inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of arrivals: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--concurrency", "--max-concurrency", dest="concurrency", type=int,
                   help="at most this many requests in flight")
    p.add_argument("--warmup", type=int, default=0, help="untimed requests sent first")
    p.add_argument("--alone-probes", type=int, default=3,
                   help="short requests sent one at a time to measure TTFT alone (0: skip)")
    p.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                   help="per-request targets ttft:MS,tpot:MS,e2el:MS for request_goodput")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--sweep-rates", type=float_list, metavar="R1,R2,...",
                       help="run once per request rate, stopping past saturation")
    sweep.add_argument("--sweep-concurrency", type=int_list, metavar="C1,C2,...",
                       help="run once per concurrency, stopping past saturation")
    p.add_argument("--saturation-min-gain", type=float, default=0.10,
                   help="sweep: past saturation when throughput grows less than this")
    p.add_argument("--saturation-latency-factor", type=float, default=5.0,
                   help="sweep: past saturation when P99 E2E exceeds this x the lightest load's")
    p.add_argument("--saturation-max-failures", type=float, default=0.05,
                   help="sweep: past saturation when more than this fraction fails")
    p.set_defaults(func=serving_command)


def add_traffic_parser(sub) -> None:
    p = sub.add_parser("traffic", help="closed-loop simulated users with a time series")
    add_server_args(p)
    p.add_argument("--num-users", type=int, default=10)
    p.add_argument("--duration", type=float, default=60.0, help="seconds users keep sending")
    p.add_argument("--think-time", type=float, default=1.0,
                   help="mean seconds a user thinks between reply and next request")
    p.add_argument("--mix", default="interactive:1",
                   help="lanes of users with weights, e.g. interactive:0.8,batch:0.2")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-input-len", type=int, default=2048, help="lane 'batch' prompt tokens")
    p.add_argument("--batch-output-len", type=int, default=512, help="lane 'batch' max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--long-threshold", type=int, default=1024)
    p.set_defaults(func=traffic_command)


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="HTML page or PNG of charts from result JSON files")
    p.add_argument("results", nargs="+", metavar="RESULT", help="result JSON files")
    p.add_argument("--output", required=True, help="report.html or chart.png")
    p.add_argument("--compare", action="store_true",
                   help="add a side-by-side table, as ratios to the first result")
    p.add_argument("--labels", help="comma-separated names for the results")
    p.set_defaults(func=report_command)


def add_one_batch_parser(sub) -> None:
    p = sub.add_parser("one-batch", help="one static batch in-process: prefill and decode step "
                                         "latency, bandwidth against the floor")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: the built-in tiny model)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=128,
                   help="tokens generated per request (EOS ignored)")
    p.add_argument("--quantization", default="none",
                   help="weight quantization of the timed engine (none, fp8, awq, gptq, compressed-tensors); a "
                        "quantized run (or --kv-cache-dtype fp8) also reports accuracy against the unquantized "
                        "model: teacher-forced top-1 agreement, mean KL, perplexity difference, with standard errors")
    p.add_argument("--baseline-model", default=None,
                   help="the unquantized model for the accuracy report (default: MODEL without quantization)")
    p.add_argument("--accuracy-trials", type=int, default=3, help="repeated accuracy runs (fresh texts each)")
    p.add_argument("--accuracy-texts", type=int, default=8, help="texts per accuracy trial")
    p.add_argument("--accuracy-text-len", type=int, default=256, help="tokens per accuracy text")
    p.add_argument("--accuracy-chart", default=None,
                   help="write a PNG: per-text accuracy before/after, standard error vs number of trials")
    p.add_argument("--peak-bandwidth", type=float, default=None,
                   help="GPU memory bandwidth in B/s for the floor (default 4.27e12: one H200's "
                        "measured device copy)")
    p.add_argument("--output", help="write the result JSON here")
    add_cli_args(p, skip=("model", "batching", "max_batch_size", "scheduling_policy", "quantization"))
    p.set_defaults(func=one_batch_command)


def add_flat_latency_parser(sub) -> None:
    p = sub.add_parser("flat-latency", help="does a short request wait for a long one? TTFT alone "
                                            "and mixed, per batching mode, in-process or against "
                                            "a server")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: the built-in tiny model); with --base-url, the "
                        "model name to request (default: the first of GET /v1/models)")
    add_client_args(p, base_url_required=False)
    p.add_argument("--input-lens", type=int_list, default=[8, 64, 512, 1536],
                   metavar="N1,N2,...",
                   help="(a) prompt lengths sent alone, capped by the model's context")
    p.add_argument("--num-short", type=int, default=8, help="(b) short prompts sent together")
    p.add_argument("--short-len", type=int, default=16, help="(b) tokens of a short prompt")
    p.add_argument("--long-len", type=int, default=1536,
                   help="(b) tokens of the long prompt, sent first")
    p.add_argument("--output-len", type=int, default=4,
                   help="tokens generated per request (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each scenario; TTFTs are medians")
    p.add_argument("--modes", type=str_list, default=list(MODE_NAMES), metavar="M1,M2,...",
                   help="in-process rows, each a fresh engine: static, dynamic, continuous (fcfs), "
                        "continuous-lanes (deadline policy; the long prompt in the batch lane)")
    p.add_argument("--baseline", choices=("hf",),
                   help="add a row of transformers generate (one left-padded static batch) on "
                        "the same prompts")
    p.add_argument("--output", help="write the result JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_cli_args(p, skip=("model", "batching", "scheduling_policy", "tokenizer"))
    p.set_defaults(func=flat_latency_command)


def add_scenario_parsers(sub) -> None:
    """``scenarios`` (issue #20's measurements) and ``doctor`` (those, a diagnosis and flags)."""
    scenarios = ("isolated", "beside-long", "mixed", "goodput")  # scenarios.SCENARIOS (heavy imports)
    for name, help_text in (("scenarios", "flat-latency scenarios against a server: shorts beside a long "
                                          "prompt, Poisson mixed load, goodput sweep, isolated TTFT"),
                            ("doctor", "is the server flat? names the cause and prints the flags, with values, "
                                       "that address it (expresslane, vLLM or SGLang names)")):
        p = sub.add_parser(name, help=help_text)
        add_client_args(p)
        p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
        p.add_argument("--seed", type=int, default=0)
        if name == "scenarios":
            p.add_argument("--run", type=str_list, default=list(scenarios), metavar="S1,S2,...",
                           help=f"which scenarios: {', '.join(scenarios)}")
        p.add_argument("--short-len", type=int, default=64, help="tokens of a short prompt")
        p.add_argument("--long-len", type=int, default=8192,
                       help="tokens of a long prompt (cut to the server's context)")
        p.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
        p.add_argument("--num-short", type=int, default=16, help="short prompts sent beside the long one")
        p.add_argument("--lead-ms", type=float, default=5.0, help="the shorts leave this long after the long one")
        p.add_argument("--repeats", type=int, default=3, help="runs of the burst and isolated scenarios")
        p.add_argument("--rate", type=float, default=8.0, help="mixed: requests/s (Poisson)")
        p.add_argument("--duration", type=float, default=20.0 if name == "scenarios" else 10.0,
                       help="mixed: seconds of arrivals")
        p.add_argument("--long-fraction", type=float, default=0.15, help="mixed and goodput: share of long prompts")
        p.add_argument("--rates", type=float_list, default=[8.0, 16.0, 24.0, 32.0], metavar="R1,R2,...",
                       help="goodput: offered rates")
        p.add_argument("--sweep-duration", type=float, default=15.0, help="goodput: seconds per rate")
        p.add_argument("--isolated-lens", type=int_list, default=[128, 2048, 8192], metavar="N1,N2,...",
                       help="isolated: prompt lengths (cut to the server's context)")
        p.add_argument("--long-lane", choices=("interactive", "batch"),
                       help="send long prompts in this lane (expresslane's lanes; others ignore it)")
        p.add_argument("--slo", default="100,25,1000", metavar="SHORT_TTFT,SHORT_TPOT,LONG_TTFT",
                       help="goodput SLO in ms")
        p.add_argument("--chart", help="write a PNG chart here")
        p.add_argument("--output", help="write the result JSON here")
        p.set_defaults(func=scenarios_command, bench_name=name)


def scenario_config(args: argparse.Namespace):
    from expresslane.bench.scenarios import SCENARIOS, ScenarioConfig

    slo = float_list(args.slo)
    if len(slo) != 3:
        raise ValueError(f"--slo takes three numbers (short TTFT, short TPOT, long TTFT in ms), got {args.slo!r}")
    return ScenarioConfig(
        client=client_options(args, args.model), run=tuple(getattr(args, "run", SCENARIOS)),
        short_len=args.short_len, long_len=args.long_len, output_len=args.output_len, num_short=args.num_short,
        lead_ms=args.lead_ms, repeats=args.repeats, rate=args.rate, duration=args.duration,
        long_fraction=args.long_fraction, rates=tuple(args.rates), sweep_duration=args.sweep_duration,
        isolated_lens=tuple(args.isolated_lens), long_lane=args.long_lane, short_ttft_ms=slo[0],
        short_tpot_ms=slo[1], long_ttft_ms=slo[2], seed=args.seed)


def scenarios_command(args: argparse.Namespace) -> int:
    from expresslane.bench import records
    from expresslane.bench.doctor import DoctorConfig, format_doctor, run_doctor
    from expresslane.bench.flat_report import format_scenarios, write_chart
    from expresslane.bench.scenarios import run_scenarios

    try:
        if args.bench_name == "doctor":
            result = run_doctor(DoctorConfig(scenario_config(args)))
            print(format_doctor(result))
        else:
            result = run_scenarios(scenario_config(args))
            print(format_scenarios(result))
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    if args.chart:
        print(f"wrote {write_chart(result, args.chart, result['base_url'])}")
    if args.output:
        records.save_result(result, args.output)
    return 0


def add_throughput_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline generation throughput in-process, against "
                                          "transformers generate on the same prompts")
    p.add_argument("model", nargs="?", default=None,
                   help="model directory (default: the built-in tiny model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--hf-batch-size", type=int, default=64, help="transformers' static batch size")
    p.add_argument("--no-baseline", action="store_true", help="expresslane only")
    p.add_argument("--output", help="write the result JSON here")
    add_cli_args(p)
    p.set_defaults(func=throughput_command)


def add_overhead_parser(sub) -> None:
    p = sub.add_parser("server-overhead", help="TTFT through HTTP minus the engine's own TTFT "
                                               "(an expresslane server's return_metrics)")
    add_client_args(p)
    p.add_argument("--model", help="model name to request (default: the first of GET /v1/models)")
    p.add_argument("--sequential", type=int, default=200, help="requests sent one at a time")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop streams, then")
    p.add_argument("--rounds", type=int, default=4, help="requests per stream, one after another")
    p.add_argument("--warmup", type=int, default=10, help="untimed requests first")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of every request")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--output", help="write the result JSON here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=overhead_command)


