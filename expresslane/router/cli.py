"""``expresslane router``: flags only; FastAPI, uvicorn and httpx are imported when it runs."""

from __future__ import annotations

import argparse


def add_router_parser(subparsers) -> None:
    p = subparsers.add_parser("router", help="lane-aware router in front of several `expresslane serve` replicas")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each replica)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between polls of each replica's /load; a replica that fails one is out")
    p.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    from expresslane.router.serve import run_router

    return run_router(args.backend, args.host, args.port, args.health_interval, args.log_level)
