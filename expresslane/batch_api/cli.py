"""Flags of `expresslane batch`, the Batch API offline (light: no server imports until a command runs).

``expresslane batch INPUT.jsonl -o OUTPUT.jsonl [MODEL] [engine flags]`` runs a Batch API
input file offline through the server's own code (``server/batch_offline.py``), the
counterpart of vLLM's ``run_batch``. Its flags are made from the config tree: ``BatchRunConfig``,
the batch API's section and the served model name of ``ServerConfig``, and the engine's.
"""

from __future__ import annotations

import argparse

from expresslane.config import add_cli_args
from expresslane.config.flags import add_args
from expresslane.config.server import BatchApiConfig, BatchRunConfig, ServerConfig


def add_batch_parser(subparsers) -> None:
    p = subparsers.add_parser("batch", help="run a Batch API input file (JSONL) offline, like vLLM's run_batch")
    # the positionals (not knobs)
    p.add_argument("input", help="input file: one request a line, {custom_id, method, url, body} (OpenAI's format)")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in stdlib-llama-9m)")
    add_args(p, BatchRunConfig)
    add_args(p, ServerConfig, only=("served_model_name",),
             help={"served_model_name": "the model name the request bodies use (default: the model argument, or "
                                        "'tiny')"})
    add_args(p, BatchApiConfig, help={"batch_store": (
        "keep the queue in this store (sqlite:PATH or redis://...) so an interrupted run resumes where it stopped "
        "when started again with the same input; default: a temporary SQLite file")})
    add_cli_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from expresslane.server.batch_offline import run_batch

    return run_batch(args)
