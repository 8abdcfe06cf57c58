"""Run the router: uvicorn around build_router_app, the health poller alongside."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn

from expresslane.config.server import RouterConfig
from expresslane.router.app import Router, build_router_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_router(cfg: RouterConfig, log_level: str) -> int:
    backends, host, port, health_interval = list(cfg.backend), cfg.listen.host, cfg.listen.port, cfg.health_interval
    if health_interval <= 0:
        raise ValueError(f"--health-interval must be positive, got {health_interval}")
    for url in backends:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--backend {url!r}: expected an http:// or https:// URL")
    router = Router(backends, health_interval)
    config = uvicorn.Config(build_router_app(router), host=host, port=port, log_level=log_level.lower(),
                            lifespan="off", access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        await router.start()
        print(f"expresslane router: {len(backends)} replicas behind http://{host}:{port}", file=sys.stderr,
              flush=True)
        try:
            await server.serve()
        finally:
            await router.close()

    asyncio.run(main())
    return 0
