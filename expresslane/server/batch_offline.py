"""``expresslane batch INPUT -o OUTPUT``: a Batch API file run offline, through the server's code.

The engine process, the app and the batch worker are the server's own; only the HTTP
port is missing. The input is uploaded to a store and run as one batch, with a
progress bar; with ``--batch-store`` the store outlives the command, and running the
same input again resumes the unfinished batch (no request runs after its result is
written). The output file holds every result line in input order, successes and
failures alike (as vLLM's ``run_batch`` writes them).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from expresslane.batch_api.records import ENDPOINTS, TERMINAL, FileRecord, jsonl, parse_input
from expresslane.batch_api.store import BatchStore
from expresslane.config import EngineConfig, engine_kwargs_from_args
from expresslane.config.commands import LoggingConfig
from expresslane.config.flags import from_args
from expresslane.config.server import BatchApiConfig, BatchRunConfig, ServerConfig
from expresslane.server.admission import AdmissionLimits
from expresslane.server.api import build_app
from expresslane.server.batch_routes import BatchService
from expresslane.server.engine_client import EngineClient
from expresslane.server.metrics import Metrics


def run_batch(args: argparse.Namespace) -> int:
    """The ``batch`` command: its flags are ``BatchRunConfig``, ``BatchApiConfig``, the served model name
    and the engine's; the input file and the model are its positionals."""
    run, queue = from_args(BatchRunConfig, args), from_args(BatchApiConfig, args)
    name = from_args(ServerConfig, args).model_name(args.model)
    log_level = from_args(LoggingConfig, args).log_level
    content = Path(args.input).read_bytes()
    first = next((line for line in content.decode("utf-8", "replace").splitlines() if line.strip()), "")
    endpoint = next((e for e in ENDPOINTS if f'"{e}"' in first), "/v1/completions")  # the first line's url
    items, problems = parse_input(content, endpoint)
    if problems:
        for p in problems[:10]:
            print(f"error: {args.input}:{p['line']}: {p['message']}", file=sys.stderr)
        return 2
    engine_kwargs = engine_kwargs_from_args(args)
    EngineConfig.from_kwargs(**engine_kwargs)  # bad flags fail before the engine starts
    if queue.batch_concurrency < 1 or queue.batch_lease_seconds <= 0:
        raise ValueError("--batch-concurrency and --batch-lease-seconds must be positive")
    with tempfile.TemporaryDirectory(prefix="expresslane-batch-") as tmp:
        given = queue.batch_store not in (None, "none")
        url = queue.batch_store if given else f"sqlite:{Path(tmp) / 'queue.db'}"
        return asyncio.run(_run(args.input, run.output, name, log_level, queue, engine_kwargs, url, content,
                                endpoint, len(items)))


def _find_or_create(store: BatchStore, content: bytes, name: str, endpoint: str) -> str:
    """This very input's batch in the store, unfinished (a resumed run) or completed (nothing to run), else a
    new one."""
    file_id = "file-" + hashlib.sha256(content).hexdigest()[:24]
    if store.get_file(file_id) is None:
        store.put_file(FileRecord(file_id, len(content), int(time.time()), name, "batch"), content)
    for b in store.open_batches() + store.list_batches(None, 100):
        if b.input_file_id == file_id and b.status in ("in_progress", "completed"):
            return b.id
    return store.create_batch(file_id, endpoint, "24h", None, int(time.time())).id


async def _run(input_path: str, output: str, name: str, log_level: str, queue: BatchApiConfig, engine_kwargs: dict,
               url: str, content: bytes, endpoint: str, total: int) -> int:
    lanes = EngineConfig.from_kwargs(**engine_kwargs).scheduler.lane_slo
    metrics = Metrics(name, lanes)
    client = EngineClient(engine_kwargs, metrics, AdmissionLimits(), log_level.upper())
    batches = BatchService(url, concurrency=queue.batch_concurrency, lease=queue.batch_lease_seconds,
                           poll=min(0.5, queue.batch_lease_seconds / 3))
    try:
        await client.start()
        app = build_app(client, ServerConfig(served_model_name=name), metrics, batches)
        store = batches.store
        batch_id = await asyncio.to_thread(_find_or_create, store, content, os.path.basename(input_path), endpoint)
        b = await asyncio.to_thread(store.get_batch, batch_id)
        bar = tqdm(total=total, initial=b.completed + b.failed, desc="batch", unit="req", dynamic_ncols=True)
        batches.start(app, on_result=lambda item, result: bar.update(1))
        while b.status not in TERMINAL:
            await asyncio.sleep(batches.poll)
            b = await asyncio.to_thread(store.get_batch, batch_id)
        bar.close()
        results = sorted(await asyncio.to_thread(store.results, batch_id), key=lambda r: r.index)
        Path(output).write_bytes(jsonl([r.line() for r in results]))
        print(f"{b.completed} succeeded, {b.failed} failed -> {output}", file=sys.stderr)
        return 0
    finally:
        await batches.stop()
        await client.close()
