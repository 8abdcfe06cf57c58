"""The config tree (expresslane/config/) is the one source of every user-facing flag: each flag of
every command is made from a knob, its help shows the knob's default, an unset flag leaves that
default in charge, and no server/bench module writes a tree knob's default a second time."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import expresslane
from expresslane.cli.main import build_parser
from expresslane.config.bench import ClientOptions, ScenarioConfig, ServingConfig, SweepConfig
from expresslane.config.engine import engine_kwargs_from_args
from expresslane.config.flags import from_args, knobs, shown
from expresslane.config.server import AdmissionConfig, BatchRunConfig, RequestLimits, RouterConfig, ServerConfig

ROOT = Path(expresslane.__file__).parent
TREE_MODULES = [importlib.import_module(f"expresslane.config.{m}") for m in ("engine", "server", "bench", "commands")]
SECTIONS = {c for m in TREE_MODULES for c in vars(m).values()
            if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == m.__name__}
KNOBS = {f"{owner.__name__}.{f.name}": f for section in SECTIONS for owner, f in knobs(section)}
# Positionals are hand-written (flags.py makes flags only): the model, make-model's preset and
# directory, batch's input file, report's result files.
POSITIONALS = {"model", "preset", "dir", "input", "results"}


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its command line ("", "serve", "bench serving", ...)."""
    out, todo = {}, [("", build_parser())]
    while todo:
        name, parser = todo.pop()
        out[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}".strip(), p) for sub, p in action.choices.items()]
    return out


def test_every_flag_comes_from_the_tree():
    commands = parsers()
    assert {"serve", "router", "batch", "generate", "make-model", "bench serving", "bench traffic",
            "bench flat-latency", "bench one-batch", "bench doctor", "bench server-overhead"} <= set(commands)
    by_hand = []
    for name, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if not action.option_strings:
                assert action.dest in POSITIONALS, f"{name}: positional {action.dest}"
            elif action.dest not in KNOBS:
                by_hand.append(f"{name}: {'/'.join(action.option_strings)}")
            else:
                assert action.default is argparse.SUPPRESS, action.option_strings  # the knob's default rules
    assert not by_hand, "flags not made from the config tree:\n" + "\n".join(by_hand)


@pytest.mark.parametrize("command", ["serve", "router", "batch", "generate", "bench serving", "bench traffic",
                                     "bench flat-latency", "bench one-batch", "bench scenarios", "bench doctor",
                                     "bench throughput", "bench server-overhead", "bench report"])
def test_help_shows_every_default_the_tree_holds(command):
    parser = parsers()[command]
    text = re.sub(r"\s+", "", parser.format_help())
    checked = 0
    for action in parser._actions:
        f = KNOBS.get(action.dest)
        if f is None or f.default in (None, dataclasses.MISSING, (), "") or (
                f.default is False and isinstance(action, argparse._StoreTrueAction)):
            continue
        assert f"(default:{shown(f.default)})".replace(" ", "") in text, (command, action.option_strings)
        checked += 1
    assert checked or command == "bench report"


def test_the_doctor_has_its_own_default_and_the_rest_is_shared():
    text = {c: re.sub(r"\s+", " ", parsers()[c].format_help()) for c in ("bench scenarios", "bench doctor")}
    assert "seconds of arrivals (default: 20.0)" in text["bench scenarios"]
    assert "seconds of arrivals (default: 10.0)" in text["bench doctor"]
    assert "--run" not in text["bench doctor"] and "(default: 100,25,1000)" in text["bench doctor"]


def test_unset_flags_leave_the_tree_defaults_and_given_ones_arrive_typed():
    parse = build_parser().parse_args
    args = parse(["serve"])
    assert from_args(ServerConfig, args) == ServerConfig()
    assert engine_kwargs_from_args(args) == {"model": None}  # the engine's own defaults rule too
    args = parse(["serve", "m", "--port", "9", "--max-waiting-tokens", "5", "--slo-admission", "--max-logprobs", "3",
                  "--batch-store", "none", "--no-enable-prefix-caching"])
    server = from_args(ServerConfig, args)
    assert (server.listen.port, server.admission, server.limits.max_logprobs, server.batch.batch_store) == (
        9, AdmissionConfig(max_waiting_tokens=5, slo_admission=True), 3, "none")
    assert server.listen.host == ServerConfig().listen.host and server.limits == RequestLimits(max_logprobs=3)

    args = parse(["bench", "serving", "--base-url", "http://x", "--max-concurrency", "4", "--header", "A:b",
                  "--header", "C:d", "--goodput", "ttft:5", "e2el:9", "--sweep-rates", "1,2.5", "--top-k", "3"])
    cfg = from_args(ServingConfig, args)
    assert cfg == ServingConfig(ClientOptions("http://x", header=("A:b", "C:d"),
                                              sampling=dataclasses.replace(ClientOptions().sampling, top_k=3)),
                                max_concurrency=4, goodput=("ttft:5", "e2el:9"))
    assert from_args(SweepConfig, args) == SweepConfig(rates=(1.0, 2.5))

    assert from_args(BatchRunConfig, parse(["batch", "in.jsonl", "-o", "out.jsonl"])).output == "out.jsonl"
    router = from_args(RouterConfig, parse(["router", "--backend", "http://a", "--backend", "http://b"]))
    assert router == RouterConfig(backend=("http://a", "http://b"))
    assert router.listen == ServerConfig().listen  # one default for the address, the server's
    scen = from_args(ScenarioConfig, parse(["bench", "scenarios", "--base-url", "u", "--slo", "50,10,900"]))
    assert (scen.short_ttft_ms, scen.short_tpot_ms, scen.long_ttft_ms) == (50.0, 10.0, 900.0)


def test_a_bad_value_is_refused_naming_its_flag():
    with pytest.raises(ValueError, match="--max-waiting-requests must be positive, got 0"):
        ServerConfig(admission=AdmissionConfig(max_waiting_requests=0)).validate()
    with pytest.raises(ValueError, match="--max-stop-strings must be >= 0, got -1"):
        ServerConfig(limits=RequestLimits(max_stop_strings=-1)).validate()
    with pytest.raises(ValueError, match="--batch-lease-seconds must be positive"):
        ServerConfig(batch=dataclasses.replace(ServerConfig().batch, batch_lease_seconds=0)).validate()
    with pytest.raises(ValueError, match="endpoint must be one of"):
        ClientOptions(endpoint="embeddings")


# Fields and parameters outside the tree that share a knob's name but are not that knob, each
# with why. Anything else in these packages holding a literal default for a knob's name fails.
NOT_THE_KNOB = {
    ("server/protocol.py", "ignore_eos"): "a request field: the OpenAI API's default, not a flag's",
    ("server/wire.py", "max_num_batched_tokens"): "a field of the engine's reply, filled by the engine",
    ("bench/records.py", "output_len"): "a measured request's field",
    ("bench/datasets.py", "prefix_len"): "draw_prompts: 0 = no shared prefix (the caller passes the knob)",
}


def literal_defaults(path: Path):
    """(name, line, source) of each dataclass field and parameter with a literal default other than None."""
    def literal(node: ast.AST) -> bool:
        try:
            return ast.literal_eval(node) is not None
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            if literal(node.value):
                yield node.target.id, node.lineno, ast.unparse(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            yield from ((arg.arg, node.lineno, ast.unparse(d)) for arg, d in pairs if literal(d))


def test_no_default_is_written_twice():
    """The server, bench, batch, router and command-line modules take their defaults from the tree
    (a config instance, or ``default_of``); none writes a tree knob's default again."""
    names = {f.name for f in KNOBS.values()}
    twice = []
    for pkg in ("server", "bench", "batch_api", "router", "cli", "client"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            twice += [f"{rel}:{line}: {name} = {src}" for name, line, src in literal_defaults(path)
                      if name in names and (rel, name) not in NOT_THE_KNOB]
    assert not twice, "defaults written outside the config tree:\n" + "\n".join(twice)


def test_the_checker_sees_a_second_default(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from dataclasses import dataclass\n@dataclass\nclass C:\n    port: int = 8000\n"
                    "    api_key: str | None = None\n\ndef f(x, *, shutdown_timeout=30.0):\n    pass\n")
    assert sorted(name for name, _, _ in literal_defaults(path)) == ["port", "shutdown_timeout"]


def test_the_config_imports_neither_the_engine_nor_the_server():
    code = ("import sys, expresslane.config, expresslane.config.server, expresslane.config.bench, "
            "expresslane.config.commands, expresslane.cli.main as m; m.build_parser(); "
            "bad = sorted(x for x in sys.modules if x.split('.')[0] in ('torch', 'fastapi', 'uvicorn', 'zmq', "
            "'msgspec', 'pydantic', 'aiohttp', 'numpy') or x.startswith('expresslane.engine')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
