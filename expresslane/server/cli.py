"""``expresslane serve``: flags only. The server's heavy imports (FastAPI, uvicorn, ZeroMQ)
happen when the command runs, so ``expresslane --help`` and the offline engine stay light."""

from __future__ import annotations

import argparse
import sys

from expresslane.batch.cli import add_batch_args
from expresslane.config import add_cli_args


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (SSE streaming, Prometheus metrics)")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in tiny model)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*, /generate, "
                   "/tokenize")
    s.add_argument("--api-key-file", default=None,
                   help="TOML file of API keys, each with optional rate limits ([keys.NAME] key = ..., "
                        "requests_per_second = ..., tokens_per_minute = ...); over a limit: 429 + Retry-After")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: the model argument, or 'tiny')")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="admission cap: sequences (prompts x n) admitted but not yet producing tokens; over it, "
                        "503 + Retry-After (a request larger than the cap on its own: 400)")
    s.add_argument("--max-waiting-tokens", type=int, default=None,
                   help="admission cap: prompt tokens of those sequences; over it, 503 + Retry-After (a request "
                        "larger than the cap on its own: 400)")
    s.add_argument("--slo-admission", action="store_true",
                   help="refuse (503 + Retry-After) interactive requests that cannot get their first token "
                        "within the interactive lane's TTFT target (--lane-slo) given the prompts ahead")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take from arrival; then it is aborted, its KV freed (504)")
    s.add_argument("--enable-request-merging", action="store_true",
                   help="identical concurrent requests (same prompt and parameters, greedy or seeded) share one "
                        "generation; hit rate in /metrics (request_merge_hits_total / request_merge_queries_total)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: refuse new requests and give in-flight ones this many seconds to finish; "
                        "then they end with an error (streams: an SSE error event and [DONE]) and the server exits")
    s.add_argument("--engine-restarts", type=int, default=3,
                   help="when the engine process dies: fail the requests in flight and start a new engine (backoff "
                        "0.5 s, doubling), at most this many times in the server's life; then exit 1")
    lim = p.add_argument_group("request limits (over one: 413 or 400 naming the limit)")
    lim.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20, help="request body size")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="characters of one prompt (or chat messages), checked before tokenizing (default: what "
                          "the model's context could hold, max_model_len x the longest token's characters)")
    lim.add_argument("--max-stop-strings", type=int, default=64, help="stop strings of one request")
    lim.add_argument("--max-sequences-per-request", type=int, default=256,
                     help="completions of one request: prompts x n")
    lim.add_argument("--max-logprobs", type=int, default=20, help="logprobs / top_logprobs of one request")
    s.add_argument("--profile-dir", default=None,
                   help="enable POST /start_profile and /stop_profile: torch profiler traces of the engine "
                        "process, written here as Chrome trace JSON")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="run N replicas of the server and engine (on GPU: each on its own tensor-parallel-size "
                        "GPUs) behind the lane-aware router on --host/--port")
    add_batch_args(p.add_argument_group("batch API"))
    add_cli_args(p)
    p.set_defaults(func=_serve)


# The [server] extra's modules (pyproject.toml), by their import names.
SERVER_MODULES = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "zmq", "msgspec",
                  "prometheus_client"}


def _serve(args: argparse.Namespace) -> int:
    if getattr(args, "node_rank", 0) != 0:
        from expresslane.distributed.node import run_worker_node

        return run_worker_node(args)
    if args.data_parallel_size != 1:
        from expresslane.router.data_parallel import serve_data_parallel

        return serve_data_parallel(args.data_parallel_size, getattr(args, "tensor_parallel_size", 1), args.host,
                                   args.port, args.log_level, sys.argv[1:])
    try:
        from expresslane.server.launch import serve
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        print(f"error: `expresslane serve` needs the server extra (module {e.name!r} is not installed). "
              "Install it with: pip install 'expresslane[server]'  (from a clone: pip install -e \".[server]\")",
              file=sys.stderr)
        return 1
    return serve(args)
