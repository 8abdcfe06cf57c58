"""The pooling endpoints of a server started with ``--runner pooling`` (docs/api.md):
``/v1/embeddings`` (OpenAI's), and vLLM's ``/pooling``, ``/score`` and ``/rerank``.

Each input is one engine request (``EngineClient.submit`` with ``PoolingParams``) whose prefill
ends with its vector; the scheduler batches them with each other and orders them by lane.
Scores are the cosine similarity of two embeddings, as vLLM scores with an embedding model. A
server started for generation refuses these routes with a 400, and a pooling server refuses the
generation routes (``api.py``), as vLLM does.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from typing import Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from expresslane.config.server import ServerConfig
from expresslane.engine.inputs import InputError
from expresslane.outputs import EmbeddingRequestOutput
from expresslane.pooling_params import PoolingParams
from expresslane.server import errors
from expresslane.server.engine_client import EngineClient
from expresslane.server.pooling_protocol import (
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    inputs_of,
)
from expresslane.server.protocol import parse
from expresslane.server.serving import chat_prompt, check_prompt_chars, new_id

_encode_json = msgspec.json.Encoder().encode
_INLINE_BYTES = 64 * 1024  # a larger body is tokenized in a worker thread (as api.py does)

Respond = Callable[[Request, Awaitable[bytes], Callable[[], None]], Awaitable[Response]]


def not_pooling() -> errors.APIError:
    return errors.bad_request("this server runs a generation model; embeddings, /pooling, /score and /rerank need a "
                              "server started with --runner pooling (an embedding model)", None, "wrong_runner")


def generation_refused() -> errors.APIError:
    return errors.bad_request("this server runs an embedding model (--runner pooling): it serves /v1/embeddings, "
                              "/pooling, /score and /rerank, not text generation", None, "wrong_runner")


def base64_floats(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def field_names(param: str, value: str | list) -> list[str]:
    """Each input's name in errors: `input`, or `input[i]` for a list."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [param]
    return [f"{param}[{i}]" for i in range(len(value))]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


class PoolingRoutes:
    """What the four routes share: checks, tokenization, one submission, the outputs in order."""

    def __init__(self, client: EngineClient, settings: ServerConfig, model_name: str,
                 check_model: Callable[[str | None], None], respond: Respond, template: str | None = None):
        """`template`: the server's --chat-template (for `messages` inputs)."""
        self.client, self.settings, self.model_name = client, settings, model_name
        self.check_model, self.respond, self.template = check_model, respond, template

    async def conversation(self, req: EmbeddingRequest) -> list[dict]:
        """vLLM's chat embeddings: the messages through the chat template, one input of token ids."""
        check_prompt_chars(self.client, self.settings.limits, [sum(len(m.text()) for m in req.messages)], "messages",
                           req.truncate_prompt_tokens)
        text, ids = await asyncio.to_thread(chat_prompt, self.client.tokenizer, req.messages, req.add_generation_prompt,
                                            None, req.chat_template or self.template, req.chat_template_kwargs,
                                            req.continue_final_message)
        return [{"prompt_token_ids": ids, "prompt": text}]

    def _tokenize(self, raw: list[str | dict], add_special_tokens: bool, names: list[str], keep: int | None
                  ) -> list[tuple[str | None, list[int]]]:
        client = self.client
        prompts = []
        for item, where in zip(raw, names):
            try:
                if isinstance(item, str) and not add_special_tokens:
                    text, ids = item, client.tokenizer.encode(item, add_special_tokens=False)
                else:
                    text, ids = client.inputs.tokenize(item)
                text, ids = client.inputs.truncate(text, ids, keep)
                client.inputs.check_pooling(ids)
            except InputError as e:
                raise errors.bad_request(str(e), e.field(where), e.code) from None
            prompts.append((text, ids))
        return prompts

    async def run(self, request: Request, req, raw: list[str | dict], names: list[str], params: PoolingParams,
                  prefix: str, size: int, answer: Callable[[list[EmbeddingRequestOutput]], dict]) -> Response:
        """Check, tokenize, submit; the body is `answer(outputs in input order)` as JSON. `names`: each
        input's field, for errors."""
        param = names[0].partition("[")[0]
        client = self.client
        self.check_model(req.model)
        client.check_accepting()
        if client.runner_type != "pooling":
            raise not_pooling()
        if params.dimensions is not None and params.dimensions > client.hidden_size:
            raise errors.bad_request(f"'dimensions' must be at most {client.hidden_size} (the model's hidden size), "
                                     f"got {params.dimensions}", "dimensions")
        limits = self.settings.limits
        if len(raw) > limits.max_sequences_per_request:
            raise errors.bad_request(f"{len(raw)} inputs is more than this server takes in one request "
                                     f"({limits.max_sequences_per_request}, --max-sequences-per-request)", param)
        keep = req.truncate_prompt_tokens
        check_prompt_chars(client, limits, [len(p) for p in raw if isinstance(p, str)], param, keep)
        if size > _INLINE_BYTES:
            prompts = await asyncio.to_thread(self._tokenize, raw, req.add_special_tokens, names, keep)
        else:
            prompts = self._tokenize(raw, req.add_special_tokens, names, keep)
        group = client.submit(new_id(prefix), prompts, params, priority=req.priority, lane=req.lane,
                              timeout=self.settings.request_timeout)

        async def collect() -> bytes:
            done: dict[str, EmbeddingRequestOutput] = {}
            async for out in group.outputs():
                done[out.request_id] = out
            return _encode_json(answer([done[key] for key in group.tracked]))

        return await self.respond(request, collect(), group.close)

    def usage(self, outs: list[EmbeddingRequestOutput]) -> dict:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return {"prompt_tokens": n, "total_tokens": n}

    def header(self, prefix: str, outs: list[EmbeddingRequestOutput]) -> dict:
        return {"id": new_id(prefix), "object": "list", "created": int(time.time()), "model": self.model_name,
                "usage": self.usage(outs)}


def add_pooling_routes(app: FastAPI, routes: PoolingRoutes, body, auth) -> None:
    """`body(request) -> (decoded JSON, size)`: api.py's reader (limits first)."""

    def vectors(model, name: str, obj: str, field: str, prefix: str):
        """The handler of a route that answers one vector per input (`obj` objects, in `field`)."""
        async def handler(request: Request) -> Response:
            decoded, size = await body(request)
            req = parse(model, decoded)
            b64 = req.encoding_format == "base64"

            def answer(outs: list[EmbeddingRequestOutput]) -> dict:
                data = [{"object": obj, "index": i,
                         field: base64_floats(o.outputs.embedding) if b64 else o.outputs.embedding}
                        for i, o in enumerate(outs)]
                return {**routes.header(prefix, outs), "data": data}

            if (refused := req.refusal()) is not None:
                raise errors.bad_request(*refused)
            if req.messages is not None:
                raw, names = await routes.conversation(req), ["messages"]
            else:
                raw, names = inputs_of(req.input), field_names("input", req.input)
            return await routes.run(request, req, raw, names, PoolingParams(req.dimensions, req.normalize), prefix,
                                    size, answer)
        handler.__name__ = name
        return handler

    app.post("/v1/embeddings", dependencies=auth)(vectors(EmbeddingRequest, "embeddings", "embedding", "embedding",
                                                          "embd"))
    app.post("/pooling", dependencies=auth)(vectors(PoolingRequest, "pooling", "pooling", "data", "pool"))

    async def score(request: Request) -> Response:
        obj, size = await body(request)
        req = parse(ScoreRequest, obj)
        first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if len(first) != 1 and len(first) != len(second):
            raise errors.bad_request(f"'text_2' must have as many texts as 'text_1' ({len(first)}), or 'text_1' one "
                                     f"text; got {len(second)}", "text_2")
        pairs = [(0 if len(first) == 1 else j, len(first) + j) for j in range(len(second))]

        def answer(outs: list[EmbeddingRequestOutput]) -> dict:
            vecs = [o.outputs.embedding for o in outs]
            data = [{"index": j, "object": "score", "score": cosine(vecs[a], vecs[b])} for j, (a, b) in enumerate(pairs)]
            return {**routes.header("score", outs), "data": data}

        names = field_names("text_1", req.text_1) + field_names("text_2", req.text_2)
        return await routes.run(request, req, first + second, names, PoolingParams(), "score", size, answer)

    async def rerank(request: Request) -> Response:
        obj, size = await body(request)
        req = parse(RerankRequest, obj)
        docs = req.documents

        def answer(outs: list[EmbeddingRequestOutput]) -> dict:
            query = outs[0].outputs.embedding
            scored = sorted(((cosine(query, o.outputs.embedding), i) for i, o in enumerate(outs[1:])),
                            key=lambda s: (-s[0], s[1]))
            results = [{"index": i, "relevance_score": s, **({"document": {"text": docs[i]}} if req.return_documents
                                                             else {})}
                       for s, i in scored[:req.top_n or len(scored)]]
            return {"id": new_id("rerank"), "model": routes.model_name,
                    "usage": {"total_tokens": routes.usage(outs)["total_tokens"]}, "results": results}

        return await routes.run(request, req, [req.query, *docs], ["query", *field_names("documents", docs)],
                                PoolingParams(), "rerank", size, answer)

    for path in ("/score", "/v1/score"):
        app.post(path, dependencies=auth)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, dependencies=auth)(rerank)
