"""Fixtures: one fake OpenAI server per session, and result files from real CLI runs."""

from __future__ import annotations

import argparse

import pytest

from expresslane.bench.cli import add_bench_parser

from .fake_server import Behavior, FakeServer


@pytest.fixture(scope="session")
def server():
    srv = FakeServer().start()
    yield srv
    srv.stop()


def bench(*argv: str) -> int:
    """Run ``expresslane bench ARGV`` through the CLI hook; returns the exit code."""
    parser = argparse.ArgumentParser(prog="expresslane")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.fixture(scope="session")
def result_files(server, tmp_path_factory):
    """serving.json, sweep.json and traffic.json written by the CLI against the fake server."""
    out = tmp_path_factory.mktemp("results")
    common = ["--base-url", server.base_url, "--disable-tqdm"]
    server.configure(Behavior(ttft=0.05, itl=0.01, fail_every=10))
    assert bench("serving", *common, "--dataset", "mixed", "--num-prompts", "40",
                 "--input-len", "32", "--long-input-len", "1500", "--output-len", "6",
                 "--concurrency", "8", "--goodput", "ttft:80,e2el:200",
                 "--output", str(out / "serving.json")) == 0
    server.configure(Behavior(ttft=0.03, itl=0.01, capacity=2, reject_over_capacity=True))
    assert bench("serving", *common, "--num-prompts", "16", "--input-len", "16",
                 "--output-len", "4", "--sweep-concurrency", "1,2,4,8,16",
                 "--output", str(out / "sweep.json")) == 0
    server.configure(Behavior(ttft=0.03, itl=0.01, fail_every=7))
    assert bench("traffic", *common, "--num-users", "4", "--duration", "1.5",
                 "--think-time", "0.05", "--mix", "interactive:0.5,batch:0.5",
                 "--input-len", "16", "--output-len", "4", "--batch-input-len", "1200",
                 "--batch-output-len", "8", "--output", str(out / "traffic.json")) == 0
    return {name: out / f"{name}.json" for name in ("serving", "sweep", "traffic")}
