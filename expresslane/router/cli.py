"""``expresslane router``: flags only (made from ``RouterConfig``); FastAPI, uvicorn and httpx are
imported when it runs."""

from __future__ import annotations

import argparse

from expresslane.config.commands import LoggingConfig
from expresslane.config.flags import add_args, from_args
from expresslane.config.server import RouterConfig


def add_router_parser(subparsers) -> None:
    p = subparsers.add_parser("router", help="lane-aware router in front of several `expresslane serve` replicas")
    add_args(p, RouterConfig)
    p.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    from expresslane.router.serve import run_router

    return run_router(from_args(RouterConfig, args), from_args(LoggingConfig, args).log_level)
