"""The argparse hook: subcommands, exit codes, errors a user can act on."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from expresslane.bench.cli import add_bench_parser

from .conftest import bench


def closed_port_url() -> str:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expresslane")
    add_bench_parser(p.add_subparsers(dest="command"))
    return p


@pytest.mark.parametrize("argv", [["serving", "--base-url", "http://x"],
                                  ["traffic", "--base-url", "http://x"],
                                  ["report", "r.json", "--output", "o.html"],
                                  ["one-batch", "--batch-size", "2"],
                                  ["flat-latency", "--base-url", "http://x"]])
def test_subcommands_set_a_handler(argv):
    assert callable(parser().parse_args(["bench", *argv]).func)


def test_one_sweep_at_a_time(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "serving", "--base-url", "u", "--sweep-rates", "1,2",
                             "--sweep-concurrency", "1,2"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_unreachable_server_is_reported_not_raised(tmp_path, capsys):
    url = closed_port_url()
    assert bench("serving", "--base-url", url, "--num-prompts", "3", "--disable-tqdm") == 2
    assert "pass --model" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert bench("serving", "--base-url", url, "--model", "m", "--num-prompts", "3",
                 "--input-len", "8", "--alone-probes", "0", "--disable-tqdm",
                 "--output", str(out)) == 1  # nothing completed
    r = json.loads(out.read_text())
    assert r["failed"] == 3 and r["failure_reasons"] == {"ClientConnectorError": 3}
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "ttft"], "bad goodput item"),
    (["--slo", "p99_ttft:5"], "bad SLO item"),
    (["--dataset", "missing.jsonl"], "existing .jsonl file"),
])
def test_bad_options_exit_2_with_a_message(server, capsys, argv, message):
    assert bench("serving", "--base-url", server.base_url, "--disable-tqdm", *argv) == 2
    assert message in capsys.readouterr().err
