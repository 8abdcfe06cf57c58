"""LoRA adapters in the API process: the names a request's ``model`` may take beside the served
model, their ``/v1/models`` cards (with ``parent``), and vLLM's ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``.

The names live here; the engine holds the weights. Ids follow ``--lora-modules``' order
(``LoRAConfig.startup_loras``, as the engine numbers them), then one more per load, never
reused: a reloaded name gets a new id, so it never meets its old prefix-cache blocks. An unload
takes the name away at once (new requests get 404); the engine drops the weights once the
requests already sent finish.
"""

from __future__ import annotations

import asyncio
import itertools

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from expresslane.config import EngineConfig
from expresslane.contract import LoRARequest
from expresslane.server import errors
from expresslane.server.engine_client import EngineClient
from expresslane.server.limits import read_body
from expresslane.server.protocol import parse
from expresslane.server.wire import LoadLoRA, UnloadLoRA


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class LoRAModels:
    def __init__(self, engine_kwargs: dict, served_model_name: str):
        lora = EngineConfig.from_kwargs(**engine_kwargs).lora
        self.enabled = lora.enable_lora
        self.parent = served_model_name
        self.adapters: dict[str, LoRARequest] = {a.lora_name: a for a in lora.startup_loras()}
        self._ids = itertools.count(len(self.adapters) + 1)
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked and taken in one go

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def cards(self) -> list[dict]:
        return [self.card(a) for a in self.adapters.values()]

    def card(self, lora: LoRARequest) -> dict:
        return {"id": lora.lora_name, "object": "model", "created": 0, "owned_by": "expresslane",
                "root": lora.lora_path, "parent": self.parent, "max_model_len": None}

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise errors.bad_request("LoRA adapters are off: start the server with --enable-lora", None,
                                     "lora_disabled")

    async def load(self, client: EngineClient, req: LoadLoRAAdapterRequest) -> None:
        self._check_enabled()
        async with self._lock:
            if req.lora_name == self.parent or req.lora_name in self.adapters:
                raise errors.bad_request(f"the LoRA adapter {req.lora_name!r} has already been loaded (or is the "
                                         "served model's name)", "lora_name", "lora_exists")
            lora = LoRARequest(req.lora_name, next(self._ids), req.lora_path)
            await client.change_lora(LoadLoRA(lora))
            self.adapters[lora.lora_name] = lora

    async def unload(self, client: EngineClient, req: UnloadLoRAAdapterRequest) -> None:
        self._check_enabled()
        async with self._lock:
            lora = self.adapters.get(req.lora_name)
            if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
                raise errors.APIError(404, f"the LoRA adapter {req.lora_name!r} cannot be found", "not_found_error",
                                      "lora_name", "lora_not_found")
            del self.adapters[req.lora_name]  # new requests: 404 from now on
            try:
                await client.change_lora(UnloadLoRA(lora.lora_int_id))
            except errors.APIError as e:
                if e.status != 404:  # (404: the engine had restarted and never held it)
                    raise


def lora_router(client: EngineClient, models: LoRAModels, auth: list, max_body_bytes: int) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = parse(LoadLoRAAdapterRequest, await read_body(request, max_body_bytes))
        await models.load(client, req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = parse(UnloadLoRAAdapterRequest, await read_body(request, max_body_bytes))
        await models.unload(client, req)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
