"""A stand-in replica for router tests: real uvicorn, a /load it is told to report, and
completions that say which replica answered (text = its name). Run as a script:

    python fake_replica.py PORT NAME [WAITING_INTERACTIVE_TOKENS]
"""

from __future__ import annotations

import json
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build(name: str, waiting: int) -> FastAPI:
    app = FastAPI()
    seen: list[str] = []
    load = {"state": "ready", "num_running": 1 if waiting else 0, "num_waiting": 0,
            "waiting_tokens": {"interactive": waiting}, "prefill_rate": None, "max_num_batched_tokens": 256,
            # 1 ms per step + 10 us per token: a prefill of N tokens ~ N/256 steps
            "step_cost": {"knots": [1, 256], "token_times": [0.001, 0.001 + 255e-5], "k_decode": 0.0,
                          "k_prefill": 0.0, "c_mixed": 0.0}}

    @app.get("/load")
    async def get_load():
        return load

    @app.post("/set_load")
    async def set_load(request: Request):
        load.update(await request.json())
        return load

    @app.get("/seen")
    async def get_seen():
        return seen

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body["prompt"])
        if body.get("stream"):
            async def events():
                for piece in (name, "!"):
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece}]})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": name}]})

    async def pooled(request: Request):  # a pooling server's routes: which replica answered, and the body's input
        body = await request.json()
        seen.append(json.dumps(body.get("input", body.get("query", body.get("text_1")))))
        return JSONResponse({"object": "list", "model": name, "data": [{"index": 0, "embedding": [1.0]}],
                             "path": request.url.path})

    for path in ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, pooled, methods=["POST"])
    return app


if __name__ == "__main__":
    port, name = int(sys.argv[1]), sys.argv[2]
    waiting = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    uvicorn.run(build(name, waiting), host="127.0.0.1", port=port, log_level="warning")
