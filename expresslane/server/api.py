"""FastAPI routes (docs/api.md): OpenAI completions, chat and responses, /generate, /tokenize, health and metrics.

Every check that can fail (API key, JSON body, model name, server state, prompt
length, admission) runs before the response starts, so a bad request gets a real
status code. A client that goes away aborts its request in the engine, whether it
is queued, in prefill or in decode.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from expresslane import __version__
from expresslane.config.server import ServerConfig
from expresslane.contract import LoRARequest
from expresslane.server import errors, harmony
from expresslane.server.api_keys import KeyRing, token_cost
from expresslane.server.batch_routes import BatchService
from expresslane.server.completions import Completions
from expresslane.server.echo import Echo
from expresslane.server.embeddings import PoolingRoutes, add_pooling_routes, generation_refused
from expresslane.server.engine_client import EngineClient
from expresslane.server.http_middleware import HeadAndRequestId
from expresslane.server.limits import check_chars, check_tokens, precheck, read_body
from expresslane.server.load import load_snapshot
from expresslane.server.lora_routes import LoRAModels, lora_router
from expresslane.server.merging import RequestMerger
from expresslane.server.metrics import Metrics
from expresslane.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    SamplingRequest,
    TokenizeRequest,
    decode,
    parse,
)
from expresslane.server.pooling_protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from expresslane.server.response_events import Responses
from expresslane.server.responses import ResponsesRequest, in_responses_terms, parse_responses, to_chat
from expresslane.server.serving import (
    Chat,
    Generate,
    chat_prompt,
    new_id,
    prepare_chat,
    prepare_completion,
    prepare_generate,
)
from expresslane.server.tools import template_tools, tool_mode

log = logging.getLogger(__name__)

_INLINE_BYTES = 64 * 1024  # a body larger than this is tokenized in a worker thread
_PAUSE_S = 0.001  # between the long parts of a large body's handling (see _let_others_run)


async def _let_others_run() -> None:
    """A pause between two long parts of one large request's work. A bare ``sleep(0)`` lets
    the loop run once, but an engine output reaches its stream only after three turns (socket,
    tracker, the stream's writer): a timed pause lets them all run."""
    await asyncio.sleep(_PAUSE_S)


class SSEResponse(StreamingResponse):
    """An event stream whose request is aborted however the response ends (done, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], request_id: str):
        super().__init__(self._until_done(content), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._request_id = request_id
        self._done = False

    async def _until_done(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in content:
            yield chunk
        self._done = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):  # the client left while we wrote: not an error of ours
            pass
        finally:
            if not self._done:
                log.info("%s: the client left; request aborted", self._request_id)
            self._on_close()


async def _client_gone(request: Request) -> None:
    # The body is read, so the next message from the server is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_gone(request: Request, work: Awaitable[bytes], on_gone: Callable[[], None]) -> Response:
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            on_gone()
    if not task.done():
        log.info("%s %s: the client left; request aborted", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    return Response(task.result(), media_type="application/json")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it names no file."""
    if value is None:
        return None
    path = Path(value)
    try:
        return path.read_text() if path.is_file() else value
    except OSError as e:
        raise ValueError(f"--chat-template {value!r}: cannot read it ({e.strerror})") from None


def build_app(client: EngineClient, settings: ServerConfig, metrics: Metrics,
              batches: BatchService | None = None) -> FastAPI:
    app = FastAPI(title="expresslane", version=__version__)
    model_name = settings.served_model_name
    server_template = read_chat_template(settings.chat_template)
    # a grammar starts after the thinking, unless it is to hold the thinking too
    # (harmony's thinking has no </think>: a grammar holds the whole output)
    grammar_after = None if settings.structured_outputs_enable_in_reasoning or \
        settings.reasoning_parser == "openai_gptoss" else settings.reasoning_parser
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(HeadAndRequestId)

    def error_response(e: errors.APIError) -> JSONResponse:
        return JSONResponse(metrics.error_body(e), status_code=e.status, headers=e.headers)

    @app.exception_handler(errors.APIError)
    async def _api_error(request: Request, e: errors.APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(errors.APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                              kind, None, code))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, e: ClientDisconnect) -> Response:
        log.info("%s %s: the client left before sending the whole body", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(errors.internal(f"internal error: {e!r}"))

    merger = RequestMerger(client, metrics.registry, model_name) if settings.enable_request_merging else None
    keys = KeyRing.from_settings(settings.api_key, settings.api_key_file, metrics.registry)

    async def authorize(request: Request) -> None:  # async: a sync dependency would cost a thread hop
        if keys is None or (batches is not None and batches.is_worker(request)):
            return
        key = keys.authenticate(request.headers.get("authorization"))
        keys.charge_request(key)  # 429 + Retry-After over the key's requests/s
        request.state.api_key = key

    loras = LoRAModels(client.engine_kwargs, model_name)

    def check_model(name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model names (None: the served model)."""
        if name is None or name == model_name:
            return None
        lora = loras.get(name)
        if lora is None:
            raise errors.model_not_found(name, model_name)
        return lora

    auth = [Depends(authorize)]

    @app.get("/health")
    async def health() -> Response:
        status = "ok" if client.state == "ready" else client.state
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/load")
    async def load() -> dict:
        return load_snapshot(client, metrics)

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info() -> dict:
        """vLLM's: the tokenizer's special tokens and chat template (lm-eval's remote tokenizer reads it)."""
        client.check_accepting()
        tok = client.tokenizer
        return {"tokenizer_class": type(tok).__name__, "model_max_length": client.max_model_len,
                "chat_template": server_template or tok.chat_template, **{name: getattr(tok, name, None) for name in (
                    "bos_token", "eos_token", "pad_token", "unk_token")}}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "expresslane",
                "root": str(client.model_dir) if client.model_dir else None, "max_model_len": client.max_model_len}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [model_card(), *loras.cards()]}

    @app.get("/v1/models/{model:path}", dependencies=auth)  # a served name may hold slashes (org/name)
    async def model(model: str) -> dict:
        lora = check_model(model)
        return model_card() if lora is None else loras.card(lora)

    async def body(request: Request) -> tuple[object, int]:
        """The decoded body and its size in bytes. A large one is checked against the limits before
        its validation, and the loop serves others between its decoding and its validation."""
        raw = await read_body(request, settings.limits.max_request_body_bytes)
        obj = decode(raw)
        if len(raw) > _INLINE_BYTES:
            if client.state == "ready":
                precheck(obj, settings.limits, settings.limits.max_prompt_chars or client.max_prompt_chars,
                         client.max_model_len, client.inputs.vocab_size)
            await _let_others_run()
        return obj, len(raw)

    async def run(request: Request, req: SamplingRequest, prepare, endpoint, prefix: str, size: int) -> Response:
        lora = check_model(req.model)
        client.check_accepting()
        if client.runner_type == "pooling":
            raise generation_refused()
        if size > _INLINE_BYTES:  # tokenization and chat templates of a large input: off the event loop
            await _let_others_run()  # after its validation
            prompts, params = await asyncio.to_thread(prepare, client, req, settings.limits)
            await _let_others_run()
        else:
            prompts, params = prepare(client, req, settings.limits)
        if getattr(request.state, "api_key", None) is not None:  # 429 + Retry-After over the key's tokens/min
            keys.charge_tokens(request.state.api_key, token_cost(prompts, params, client.max_model_len))
        rid = new_id(prefix)
        if lora is None:
            group = (merger or client).submit(rid, prompts, params, priority=req.priority, lane=req.lane,
                                              timeout=settings.request_timeout)
        else:  # (never merged with a base-model request)
            group = client.submit(rid, prompts, params, priority=req.priority, lane=req.lane,
                                  timeout=settings.request_timeout, lora_request=lora)
        ep = endpoint(client, model_name if lora is None else lora.lora_name, rid, group, params, req.include_usage,
                      req.return_metrics, req.continuous_usage)
        # a grammar that fails (or prompt logprobs the engine refuses) is a 400, not an event
        if req.stream and (params.structured_outputs is not None or params.prompt_logprobs is not None):
            await group.started()
        if req.stream:
            return SSEResponse(ep.stream(), group.close, rid)
        return await _unless_client_gone(request, ep.collect(), group.close)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        obj, size = await body(request)
        req = parse(CompletionRequest, obj)
        return await run(request, req, prepare_completion, functools.partial(Completions, echo=Echo.of(req)), "cmpl",
                         size)

    async def chat(request: Request, req: ChatCompletionRequest, endpoint: type[Chat], prefix: str, size: int,
                   **endpoint_args) -> Response:
        check_model(req.model)
        client.check_accepting()
        template = req.chat_template or server_template or client.tokenizer.chat_template
        tools = tool_mode(req, settings.tool_call_parser, template)
        shown = template_tools(req, settings.exclude_tools_when_tool_choice_none) if tools is None else None
        harmony_on = harmony.enabled(settings.reasoning_parser, settings.tool_call_parser, template)
        after = grammar_after
        if harmony_on and not settings.structured_outputs_enable_in_reasoning and (tools is None
                                                                                  or tools.choice == "auto"):
            after = "openai_gptoss"  # the grammar holds the answer's message (a forced call: all of it)
        return await run(request, req, functools.partial(prepare_chat, tools=tools, template=server_template,
                                                          reasoning=after, shown_tools=shown,
                                                          reasoning_parser=settings.reasoning_parser),
                         functools.partial(endpoint, tools=tools, reasoning=settings.reasoning_parser,
                                           harmony=harmony_on, continued=req.continue_final_message,
                                           **endpoint_args), prefix, size)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        obj, size = await body(request)
        return await chat(request, parse(ChatCompletionRequest, obj), Chat, "chatcmpl", size)

    @app.post("/v1/responses", dependencies=auth)
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, done by the chat path (server/responses.py); nothing is stored."""
        obj, size = await body(request)
        req = parse_responses(obj)
        try:
            return await chat(request, to_chat(req), Responses, "resp", size, source=req)
        except errors.APIError as e:
            raise in_responses_terms(e, req) from None

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], dependencies=auth)
    async def stored_response(response_id: str) -> Response:
        raise errors.APIError(404, f"no response {response_id!r}: this server keeps no responses (store is "
                                   "always false)", "not_found_error", "response_id", "not_found")

    @app.post("/generate", dependencies=auth)
    async def generate(request: Request) -> Response:
        obj, size = await body(request)
        return await run(request, parse(GenerateRequest, obj), prepare_generate, Generate, "gen", size)

    @app.post("/start_profile", dependencies=auth)
    async def start_profile() -> dict:
        await client.profile(start=True)
        return {"status": "profiling", "profile_dir": client.profile_dir}

    @app.post("/stop_profile", dependencies=auth)
    async def stop_profile() -> dict:
        return {"status": "stopped", "trace": (await client.profile(start=False)).trace}

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict:
        obj, size = await body(request)
        req = parse(TokenizeRequest, obj)
        check_model(req.model)
        client.check_accepting()
        if (req.prompt is None) == (req.messages is None):
            raise errors.bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        chars = len(req.prompt) if req.prompt is not None else sum(len(m.text()) for m in req.messages)
        limit = settings.limits.max_prompt_chars or client.max_prompt_chars
        check_chars([chars], limit, client.max_model_len, "prompt" if req.prompt is not None else "messages")

        def encode() -> list[int]:
            if req.messages is not None:
                return chat_prompt(client.tokenizer, req.messages, req.add_generation_prompt,
                                   template=server_template)[1]
            return client.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

        ids = await asyncio.to_thread(encode) if size > _INLINE_BYTES else encode()
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict:
        req = parse(DetokenizeRequest, (await body(request))[0])
        check_model(req.model)
        client.check_accepting()
        check_tokens(len(req.tokens), client.max_model_len)
        vocab = client.inputs.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise errors.bad_request(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": client.tokenizer.decode(req.tokens)}

    app.include_router(lora_router(client, loras, auth, settings.limits.max_request_body_bytes))

    def check_base_model(name: str | None) -> None:
        if check_model(name) is not None:
            raise errors.bad_request(f"the model {name!r} is a LoRA adapter: pooling serves the base model only",
                                     "model")

    add_pooling_routes(app, PoolingRoutes(client, settings, model_name, check_base_model, _unless_client_gone,
                                          server_template), body,
                       auth)
    if batches is not None:
        app.include_router(batches.router(auth, lambda: client.runner_type if client.max_model_len else None))
    _describe_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                           "/v1/responses": ResponsesRequest,
                           "/generate": GenerateRequest, "/tokenize": TokenizeRequest,
                           "/detokenize": DetokenizeRequest, "/v1/embeddings": EmbeddingRequest,
                           "/pooling": PoolingRequest, "/score": ScoreRequest, "/v1/score": ScoreRequest,
                           "/rerank": RerankRequest, "/v1/rerank": RerankRequest, "/v2/rerank": RerankRequest})
    return app


def _describe_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """/openapi.json with each POST route's request body: the routes read and validate the raw
    body themselves (limits first), so FastAPI cannot see the model they parse."""
    make = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = make()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        return app.openapi_schema

    app.openapi = openapi
