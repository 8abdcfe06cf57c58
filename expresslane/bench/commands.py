"""The handlers of ``expresslane bench`` subcommands: flags in, a run, a table out, the
result JSON written. The heavy modules (torch, aiohttp, matplotlib) are imported here,
inside each handler, so that ``expresslane --help`` stays fast."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from expresslane.config import engine_kwargs_from_args


def client_options(args: argparse.Namespace, model: str | None):
    from expresslane.bench.client import ClientOptions, api_key_from_env, parse_extra_body, parse_header

    return ClientOptions(
        base_url=args.base_url, model=model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
        api_key=api_key_from_env(args.api_key),
        headers=dict(parse_header(h) for h in args.header),
        extra_body=parse_extra_body(args.extra_body),
        sampling={"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                  "min_p": args.min_p},
        tokenizer=args.tokenizer)


def engine_flags(args: argparse.Namespace) -> dict:
    """Engine flags the user gave (they default to SUPPRESS); the positional model is not one,
    nor --tokenizer, which the HTTP runs take for prompt lengths."""
    return {k: v for k, v in engine_kwargs_from_args(args).items() if k not in ("model", "tokenizer")}


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_and_report(args: argparse.Namespace, run: Callable[[], dict], table: Callable[[dict], str],
                   measured: Callable[[dict], bool] = lambda result: True) -> int:
    """Run a bench, print its table, write its JSON (``--output``). Exit 2 on a setup error
    (bad model, flags or files), 1 when the run measured nothing."""
    from expresslane.bench import records

    try:
        result = run()
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        return fail(str(e))
    print(table(result))
    if args.output:
        records.save_result(result, args.output)
    return 0 if measured(result) else 1


def serving_command(args: argparse.Namespace) -> int:
    from expresslane.bench import records, slo, stats, tables
    from expresslane.bench.datasets import DatasetSpec
    from expresslane.bench.serving import ServingConfig, run_serving
    from expresslane.bench.sweep import SaturationRule, run_sweep

    try:
        cfg = ServingConfig(
            client=client_options(args, args.model),
            dataset=DatasetSpec(args.dataset, args.num_prompts, args.input_len, args.output_len,
                                args.range_ratio, args.long_fraction, args.long_input_len,
                                args.long_threshold, args.class_lanes, args.prefix_len,
                                args.num_prefixes, args.seed),
            request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.concurrency, warmup=args.warmup, alone_probes=args.alone_probes,
            goodput=stats.parse_goodput(args.goodput), slo=slo.parse_slo(args.slo),
            disable_tqdm=args.disable_tqdm)
        if args.sweep_rates or args.sweep_concurrency:
            rule = SaturationRule(args.saturation_min_gain, args.saturation_latency_factor,
                                  args.saturation_max_failures)
            variable = "request_rate" if args.sweep_rates else "max_concurrency"
            result = run_sweep(cfg, variable, args.sweep_rates or args.sweep_concurrency, rule)
            points = result["results"]
        else:
            result = run_serving(cfg)
            points = [result]
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    for point in points:
        print(tables.format_console(point))
    if result["kind"] == "sweep":
        print(tables.text_table(tables.sweep_table(result)))
        print(f"saturation: {result['saturation_reason'] or 'not reached'}")
    if args.output:
        records.save_result(result, args.output)
    return 0 if any(p["completed"] for p in points) else 1


def traffic_command(args: argparse.Namespace) -> int:
    from expresslane.bench import records, slo, tables
    from expresslane.bench.traffic import TrafficConfig, parse_mix, run_traffic

    try:
        cfg = TrafficConfig(
            client=client_options(args, args.model),
            num_users=args.num_users, duration=args.duration, think_time=args.think_time,
            mix=parse_mix(args.mix), input_len=args.input_len, output_len=args.output_len,
            batch_input_len=args.batch_input_len, batch_output_len=args.batch_output_len,
            range_ratio=args.range_ratio, long_threshold=args.long_threshold,
            seed=args.seed, slo=slo.parse_slo(args.slo),
            disable_tqdm=args.disable_tqdm)
        result = run_traffic(cfg)
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    print(tables.format_console(result))
    if args.output:
        records.save_result(result, args.output)
    return 0 if result["completed"] else 1


def report_command(args: argparse.Namespace) -> int:
    from expresslane.bench.report import write_report

    labels = args.labels.split(",") if args.labels else None
    try:
        out = write_report(args.results, args.output, args.compare, labels)
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(f"wrote {out}")
    return 0


def one_batch_command(args: argparse.Namespace) -> int:
    from expresslane.bench.one_batch import OneBatchConfig, format_one_batch, run_one_batch

    return run_and_report(args, lambda: run_one_batch(OneBatchConfig(
        model=args.model, batch_size=args.batch_size, input_len=args.input_len,
        output_len=args.output_len, quantization=args.quantization,
        peak_bandwidth=args.peak_bandwidth, baseline_model=args.baseline_model,
        accuracy_trials=args.accuracy_trials, accuracy_texts=args.accuracy_texts,
        accuracy_text_len=args.accuracy_text_len, accuracy_chart=args.accuracy_chart,
        engine_args={k: v for k, v in engine_flags(args).items() if k != "quantization"})), format_one_batch)


def flat_latency_command(args: argparse.Namespace) -> int:
    from expresslane.bench.flat_latency import FlatLatencyConfig, format_flat_latency, run_flat_latency

    def run() -> dict:
        http = client_options(args, args.model) if args.base_url else None
        return run_flat_latency(FlatLatencyConfig(
            model=None if http else args.model, http=http,
            input_lens=tuple(args.input_lens), num_short=args.num_short, short_len=args.short_len,
            long_len=args.long_len, output_len=args.output_len, repeats=args.repeats,
            modes=tuple(args.modes), baseline=args.baseline, engine_args=engine_flags(args),
            disable_tqdm=args.disable_tqdm))

    return run_and_report(args, run, format_flat_latency,
                          lambda result: all(row["flatness"] is not None for row in result["rows"]))


def throughput_command(args: argparse.Namespace) -> int:
    from expresslane.bench.throughput import ThroughputConfig, format_throughput, run_throughput

    return run_and_report(args, lambda: run_throughput(ThroughputConfig(
        model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, hf_batch_size=args.hf_batch_size,
        baseline=None if args.no_baseline else "hf", engine_args=engine_flags(args))), format_throughput)


def overhead_command(args: argparse.Namespace) -> int:
    from expresslane.bench.overhead import OverheadConfig, format_overhead, run_overhead

    return run_and_report(args, lambda: run_overhead(OverheadConfig(
        client=client_options(args, args.model), sequential=args.sequential,
        concurrency=args.concurrency, rounds=args.rounds, warmup=args.warmup,
        prompt_len=args.prompt_len, seed=args.seed, disable_tqdm=args.disable_tqdm)),
        format_overhead, lambda result: result["sequential"]["measured"])
