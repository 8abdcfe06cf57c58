"""``expresslane serve``: flags only, made from the config tree (``ServerConfig`` with its admission,
request limits and batch API sections, then the engine's); the model is the one positional. The
server's heavy imports (FastAPI, uvicorn, ZeroMQ) happen when the command runs, so
``expresslane --help`` and the offline engine stay light."""

from __future__ import annotations

import argparse
import sys

from expresslane.config import EngineConfig, add_cli_args, engine_kwargs_from_args
from expresslane.config.commands import LoggingConfig
from expresslane.config.flags import add_args, from_args
from expresslane.config.server import ServerConfig


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (SSE streaming, Prometheus metrics)")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in stdlib-llama-9m)")
    add_args(p, ServerConfig)
    add_cli_args(p)
    p.set_defaults(func=_serve)


# The [server] extra's modules (pyproject.toml), by their import names.
SERVER_MODULES = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "zmq", "msgspec",
                  "prometheus_client"}


def _serve(args: argparse.Namespace) -> int:
    server, engine_kwargs = from_args(ServerConfig, args), engine_kwargs_from_args(args)
    log_level = from_args(LoggingConfig, args).log_level
    engine = EngineConfig.from_kwargs(**engine_kwargs)  # bad engine flags fail here, before any process
    server.validate()
    if engine.parallel.node_rank != 0:
        from expresslane.server.node import run_worker_node

        return run_worker_node(engine)
    if server.data_parallel_size != 1:
        from expresslane.router.data_parallel import serve_data_parallel

        return serve_data_parallel(server.data_parallel_size, engine.parallel.tensor_parallel_size, server.listen,
                                   log_level, sys.argv[1:])
    try:
        from expresslane.server.launch import serve
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        print(f"error: `expresslane serve` needs the server extra (module {e.name!r} is not installed). "
              "Install it with: pip install 'expresslane[server]'  (from a clone: pip install -e \".[server]\")",
              file=sys.stderr)
        return 1
    return serve(server, engine_kwargs, log_level)
