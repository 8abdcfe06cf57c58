"""Client-side request merging: small non-interactive completions made within a short window
go to the server as one multi-prompt ``/v1/completions`` request; each caller gets its own answer.

Calls merge when their parameters are equal (and their prompts are of one kind: text or
token ids). A group is sent when its window (``window`` seconds after its first call)
ends or when it holds ``max_prompts`` prompts. The server answers choice ``i * n + j`` for
prompt ``i``; caller ``i`` gets those choices, renumbered from 0, with its envelope and,
under ``merged``, the merged request's id, size and usage (the server reports usage for
the whole request, not per prompt, so ``usage`` of a merged answer is None). If the
merged request is refused as bad input (4xx), its prompts are sent one by one so only the
bad one fails.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from expresslane.client.client import APIStatusError, Client

_NOT_PROMPT_ERRORS = (401, 403, 404, 408, 429)  # about the key, the model or load: the same for every prompt


@dataclass(slots=True)
class _Group:
    params: dict
    entries: list[tuple[str | list[int], asyncio.Future]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class CompletionMerger:
    def __init__(self, client: Client, *, window: float = 0.02, max_prompts: int = 64, lane: str = "batch"):
        if window < 0 or max_prompts < 1:
            raise ValueError("window must be >= 0 and max_prompts >= 1")
        self.client, self.window, self.max_prompts, self.lane = client, window, max_prompts, lane
        self._open: dict[str, _Group] = {}
        self._tasks: set[asyncio.Task] = set()

    async def complete(self, prompt: str | list[int], **params) -> dict:
        """One prompt's completion response, as if it had been sent alone (see the module doc)."""
        if "prompt" in params or params.get("stream"):
            raise ValueError("pass the prompt as the first argument; streams are not merged")
        key = json.dumps([isinstance(prompt, str), params], sort_keys=True)
        loop = asyncio.get_running_loop()
        group = self._open.get(key)
        if group is None:
            group = self._open[key] = _Group(params)
            group.timer = loop.call_later(self.window, self._send, key)
        future = loop.create_future()
        group.entries.append((prompt, future))
        if len(group.entries) >= self.max_prompts:
            self._send(key)
        return await future

    async def flush(self) -> None:
        """Send every open group now and wait for the answers."""
        for key in list(self._open):
            self._send(key)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _send(self, key: str) -> None:
        group = self._open.pop(key, None)
        if group is None:
            return
        group.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._run(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, group: _Group) -> None:
        prompts = [p for p, _ in group.entries]
        try:
            resp = await self.client.post("/v1/completions", {**group.params, "prompt": prompts}, lane=self.lane)
        except APIStatusError as e:
            if 400 <= e.status < 500 and e.status not in _NOT_PROMPT_ERRORS and len(prompts) > 1:
                await asyncio.gather(*(self._run(_Group(group.params, [entry])) for entry in group.entries))
                return
            _fail(group, e)
            return
        except Exception as e:  # noqa: BLE001 - every caller learns why
            _fail(group, e)
            return
        n = group.params.get("n", 1)
        merged = {"id": resp.get("id"), "num_prompts": len(prompts), "usage": resp.get("usage")}
        for i, (_, future) in enumerate(group.entries):
            choices = [{**c, "index": c["index"] - i * n} for c in resp["choices"] if i * n <= c["index"] < (i + 1) * n]
            if not future.done():  # its caller may have been cancelled
                future.set_result({**resp, "choices": choices, "usage": None, "merged": merged})


def _fail(group: _Group, e: Exception) -> None:
    for _, future in group.entries:
        if not future.done():
            future.set_exception(e)
