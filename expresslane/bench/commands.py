"""The handlers of ``expresslane bench`` subcommands: flags in, a run, a table out, the
result JSON written. The heavy modules (torch, aiohttp, matplotlib) are imported here,
inside each handler, so that ``expresslane --help`` stays fast."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from expresslane.config import engine_kwargs_from_args
from expresslane.config.bench import (ChartOutput, ClientOptions, FlatLatencyConfig, OneBatchConfig, OverheadConfig,
                                      ReportConfig, ResultOutput, ServingConfig, SweepConfig, ThroughputConfig,
                                      TrafficConfig)
from expresslane.config.flags import from_args


def engine_flags(args: argparse.Namespace) -> dict:
    """Engine flags the user gave (they default to SUPPRESS); the positional model is not one."""
    return {k: v for k, v in engine_kwargs_from_args(args).items() if k != "model"}


def output_of(args: argparse.Namespace) -> str | None:
    return from_args(ResultOutput, args).output


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
    if output := output_of(args):
        records.save_result(result, output)
    return 0 if measured(result) else 1


def serving_command(args: argparse.Namespace) -> int:
    from expresslane.bench import records, tables
    from expresslane.bench.serving import run_serving
    from expresslane.bench.sweep import run_sweep

    cfg, sweep = from_args(ServingConfig, args), from_args(SweepConfig, args)
    try:
        if sweep.rates or sweep.concurrency:
            variable = "request_rate" if sweep.rates else "max_concurrency"
            result = run_sweep(cfg, variable, list(sweep.rates or sweep.concurrency), sweep.rule)
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
    if output := output_of(args):
        records.save_result(result, output)
    return 0 if any(p["completed"] for p in points) else 1


def traffic_command(args: argparse.Namespace) -> int:
    from expresslane.bench import records, tables
    from expresslane.bench.traffic import run_traffic

    try:
        result = run_traffic(from_args(TrafficConfig, args))
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    print(tables.format_console(result))
    if output := output_of(args):
        records.save_result(result, output)
    return 0 if result["completed"] else 1


def report_command(args: argparse.Namespace) -> int:
    from expresslane.bench.report import write_report

    cfg = from_args(ReportConfig, args)
    labels = cfg.labels.split(",") if cfg.labels else None
    try:
        out = write_report(args.results, cfg.output, cfg.compare, labels)
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(f"wrote {out}")
    return 0


def one_batch_command(args: argparse.Namespace) -> int:
    from expresslane.bench.one_batch import format_one_batch, run_one_batch

    cfg = from_args(OneBatchConfig, args, model=args.model, engine_args=engine_flags(args))
    return run_and_report(args, lambda: run_one_batch(cfg), format_one_batch)


def flat_latency_command(args: argparse.Namespace) -> int:
    from expresslane.bench.flat_latency import format_flat_latency, run_flat_latency

    client = from_args(ClientOptions, args, model=args.model)
    http = client if client.base_url else None
    cfg = from_args(FlatLatencyConfig, args, model=None if http else args.model, http=http,
                    engine_args=engine_flags(args))
    return run_and_report(args, lambda: run_flat_latency(cfg), format_flat_latency,
                          lambda result: all(row["flatness"] is not None for row in result["rows"]))


def scenarios_command(args: argparse.Namespace) -> int:
    """``scenarios`` and ``doctor`` (the scenarios, a diagnosis and the flags that address it)."""
    from expresslane.bench import records
    from expresslane.bench.doctor import DoctorConfig, format_doctor, run_doctor
    from expresslane.bench.flat_report import format_scenarios, write_chart
    from expresslane.bench.scenarios import run_scenarios

    cfg = from_args(args.bench_section, args)
    try:
        if args.bench_command == "doctor":
            result = run_doctor(DoctorConfig(cfg))
            print(format_doctor(result))
        else:
            result = run_scenarios(cfg)
            print(format_scenarios(result))
    except (ValueError, RuntimeError) as e:
        return fail(str(e))
    if chart := from_args(ChartOutput, args).chart:
        print(f"wrote {write_chart(result, chart, result['base_url'])}")
    if output := output_of(args):
        records.save_result(result, output)
    return 0


def throughput_command(args: argparse.Namespace) -> int:
    from expresslane.bench.throughput import format_throughput, run_throughput

    cfg = from_args(ThroughputConfig, args, model=args.model, engine_args=engine_flags(args))
    return run_and_report(args, lambda: run_throughput(cfg), format_throughput)


def overhead_command(args: argparse.Namespace) -> int:
    from expresslane.bench.overhead import format_overhead, run_overhead

    return run_and_report(args, lambda: run_overhead(from_args(OverheadConfig, args)), format_overhead,
                          lambda result: result["sequential"]["measured"])
