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

from expresslane.batch.records import TERMINAL, FileRecord, jsonl, parse_input
from expresslane.batch.store import BatchStore
from expresslane.config import EngineConfig, engine_kwargs_from_args
from expresslane.server.api import ServerSettings, build_app
from expresslane.server.batch_routes import BatchService
from expresslane.server.admission import AdmissionLimits
from expresslane.server.engine_client import EngineClient
from expresslane.server.metrics import Metrics


def run_batch(args: argparse.Namespace) -> int:
    content = Path(args.input).read_bytes()
    first = next((line for line in content.decode("utf-8", "replace").splitlines() if line.strip()), "")
    endpoint = "/v1/chat/completions" if '"/v1/chat/completions"' in first else "/v1/completions"
    items, problems = parse_input(content, endpoint)
    if problems:
        for p in problems[:10]:
            print(f"error: {args.input}:{p['line']}: {p['message']}", file=sys.stderr)
        return 2
    engine_kwargs = {**engine_kwargs_from_args(args), "model": args.model}
    EngineConfig.from_kwargs(**engine_kwargs)  # bad flags fail before the engine starts
    with tempfile.TemporaryDirectory(prefix="expresslane-batch-") as tmp:
        url = args.batch_store if args.batch_store not in (None, "none") else f"sqlite:{Path(tmp) / 'queue.db'}"
        return asyncio.run(_run(args, engine_kwargs, url, content, endpoint, len(items)))


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


async def _run(args: argparse.Namespace, engine_kwargs: dict, url: str, content: bytes, endpoint: str,
               total: int) -> int:
    name = args.served_model_name or args.model or "tiny"
    lanes = EngineConfig.from_kwargs(**engine_kwargs).scheduler.lane_slo
    metrics = Metrics(name, lanes)
    client = EngineClient(engine_kwargs, metrics, AdmissionLimits(), args.log_level.upper())
    batches = BatchService(url, concurrency=args.batch_concurrency, lease=args.batch_lease_seconds,
                           poll=min(0.5, args.batch_lease_seconds / 3))
    try:
        await client.start()
        app = build_app(client, ServerSettings(served_model_name=name), metrics, batches)
        store = batches.store
        batch_id = await asyncio.to_thread(_find_or_create, store, content, os.path.basename(args.input), endpoint)
        b = await asyncio.to_thread(store.get_batch, batch_id)
        bar = tqdm(total=total, initial=b.completed + b.failed, desc="batch", unit="req", dynamic_ncols=True)
        batches.start(app, on_result=lambda item, result: bar.update(1))
        while b.status not in TERMINAL:
            await asyncio.sleep(batches.poll)
            b = await asyncio.to_thread(store.get_batch, batch_id)
        bar.close()
        results = sorted(await asyncio.to_thread(store.results, batch_id), key=lambda r: r.index)
        Path(args.output).write_bytes(jsonl([r.line() for r in results]))
        print(f"{b.completed} succeeded, {b.failed} failed -> {args.output}", file=sys.stderr)
        return 0
    finally:
        await batches.stop()
        await client.close()
