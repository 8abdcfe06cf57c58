"""The argparse hook: subcommands, exit codes, errors a user can act on."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from expresslane.bench.cli import add_bench_parser
from expresslane.config.bench import ClientOptions
from expresslane.config.flags import from_args

from .conftest import bench


def closed_port_url() -> str:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expresslane")
    add_bench_parser(p.add_subparsers(dest="command"))
    return p


def test_version_and_help_with_defaults(capsys):
    from expresslane import __version__
    from expresslane.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"expresslane {__version__}"
    for argv in (["bench", "serving"], ["bench", "flat-latency"], ["serve"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # unwrapped
        if argv[-1] == "serving":
            assert "(default: 1024)" in text and "(default: random)" in text
            from expresslane.bench.slo import DEFAULT_SLO  # wrapped anywhere: compare without spaces
            assert f"(default:{DEFAULT_SLO})" in text.replace(" ", "")
        elif argv[-1] == "flat-latency":
            assert "(default: 8,64,512,1536)" in text and "(default: 1536)" in text
        else:
            assert "(default: 127.0.0.1)" in text and "(default: 30.0)" in text


def test_subcommands_share_the_client_flags():
    for sub in ("serving", "traffic", "flat-latency"):
        args = parser().parse_args(["bench", sub, "--base-url", "http://x", "--api-key", "k",
                                    "--header", "A:b", "--header", "C=d", "--extra-body", "{}", "--top-p", "0.5"])
        opts = from_args(ClientOptions, args)
        assert (opts.base_url, opts.api_key, opts.header, opts.extra_body, opts.sampling.top_p) == (
            "http://x", "k", ("A:b", "C=d"), "{}", 0.5)


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


def test_one_name_per_mode():
    from expresslane.bench.inprocess import MODES
    from expresslane.config.bench import MODE_NAMES

    assert MODE_NAMES == tuple(MODES)  # the CLI's default rows are the package's modes
