"""Flags of the batch tier (light: no server imports until a command runs).

``expresslane batch INPUT.jsonl -o OUTPUT.jsonl [MODEL] [engine flags]`` runs a Batch API
input file offline through the server's own code (``server/batch_offline.py``), the
counterpart of vLLM's ``run_batch``; ``add_batch_args`` adds the serve flags.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from expresslane.config import add_cli_args


def default_store_url(model_name: str) -> str:
    """One SQLite file per served model name, in expresslane's cache directory."""
    cache = Path(os.environ.get("EXPRESSLANE_CACHE") or Path.home() / ".cache" / "expresslane")
    return f"sqlite:{cache / ('batches-' + re.sub(r'[^A-Za-z0-9._-]+', '_', model_name) + '.db')}"


def add_batch_args(group, store_help: str | None = None) -> None:
    group.add_argument("--batch-store", default=None, help=store_help or (
        "the Batch API's durable queue: sqlite:PATH, or redis://HOST:PORT/DB[?prefix=NAME] for several servers "
        "sharing one queue; 'none' turns the Batch API off (default: "
        "sqlite:~/.cache/expresslane/batches-<served model name>.db)"))
    group.add_argument("--batch-concurrency", type=int, default=256,
                       help="batch requests run at once (they wait in the engine's batch lane)")
    group.add_argument("--batch-lease-seconds", type=float, default=60.0,
                       help="a claimed batch request whose server stops renewing it (crash, kill -9) is taken over "
                            "after this long; servers sharing a store must use the same value")


def add_batch_parser(subparsers) -> None:
    p = subparsers.add_parser("batch", help="run a Batch API input file (JSONL) offline, like vLLM's run_batch")
    p.add_argument("input", help="input file: one request a line, {custom_id, method, url, body} (OpenAI's format)")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("-o", "--output", required=True,
                   help="output file: one result a line in input order (OpenAI's output and error lines together)")
    p.add_argument("--served-model-name", default=None, help="the model name the request bodies use (default: the "
                   "model argument, or 'tiny')")
    add_batch_args(p.add_argument_group("queue"), store_help=(
        "keep the queue in this store (sqlite:PATH or redis://...) so an interrupted run resumes where it stopped "
        "when started again with the same input; default: a temporary SQLite file"))
    add_cli_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from expresslane.server.batch_offline import run_batch

    return run_batch(args)
