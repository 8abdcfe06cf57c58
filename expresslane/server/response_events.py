"""The Responses API's output: the ``response`` object and its SSE event stream, built from the chat
endpoint's own parsed output (``Chat.message`` whole, ``Chat.delta`` streamed), so reasoning, text
and tool calls are split once, by the chat path's parsers.

Output items, in the order the model wrote them: a ``reasoning`` item (with ``--reasoning-parser``),
a ``message`` with one ``output_text`` part, then one ``function_call`` item per call. A stream:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   content_part.added, output_text.delta..., output_text.done, content_part.done
      reasoning: content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
      call:      function_call_arguments.delta..., function_call_arguments.done
    response.output_item.done; then response.completed (or response.incomplete at max_output_tokens).

Every event carries ``sequence_number``; a failure after the header is an ``error`` event.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import AsyncIterator

from expresslane.outputs import CompletionOutput, RequestOutput
from expresslane.server import errors
from expresslane.server.responses import ResponsesRequest
from expresslane.server.serving import Chat, DeltaTracker, _encode_json

log = logging.getLogger(__name__)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _event(body: dict) -> bytes:
    return b"event: " + body["type"].encode() + b"\ndata: " + _encode_json(body) + b"\n\n"


def _text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [],
            **({} if logprobs is None else {"logprobs": logprobs})}


class Responses(Chat):
    """One ``POST /v1/responses``: a chat completion written as a Responses API response."""

    def __init__(self, *args, source: ResponsesRequest, **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source  # the request as sent: the response echoes its parameters
        self.id = "resp_" + self.id.partition("-")[2]  # the engine's request id stays as given

    # -- the response object -----------------------------------------------------------------
    def envelope_of(self, status: str, output: list[dict], usage: dict | None, finish: str | None = None) -> dict:
        r = self.source
        fmt = r.format().model_dump(by_alias=True, exclude_none=True)
        effort = r.reasoning.effort if r.reasoning is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": None,
            "metadata": r.metadata or {}, "model": self.model_name, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": {"effort": effort, "summary": None}, "service_tier": "default", "store": False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": fmt, "verbosity": "medium"},
            "tool_choice": r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump")
            else (r.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "top_logprobs": r.top_logprobs or 0, "truncation": "disabled", "background": False,
            "user": r.user, "safety_identifier": r.safety_identifier, "usage": usage,
        }

    def usage_of(self, final: RequestOutput, reasoning: str | None) -> dict:
        prompt = len(final.prompt_token_ids)
        output = sum(len(c.token_ids) for c in final.outputs)
        thought = len(self.client.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": thought}}

    def output_of(self, c: CompletionOutput) -> tuple[list[dict], str | None, str | None]:
        """(the output items, the finish reason, the reasoning text) of a finished completion."""
        message, finish = self.message(c)
        out: list[dict] = []
        reasoning = message.get("reasoning_content")
        if reasoning:
            out.append({"id": _item_id("rs"), "type": "reasoning", "summary": [], "status": "completed",
                        "content": [{"type": "reasoning_text", "text": reasoning}]})
        calls = message.get("tool_calls") or []
        lps = self.logprobs(c.token_ids, c.logprobs)
        if message["content"] or not (out or calls):  # as streamed: an empty message only for no output at all
            out.append({"id": _item_id("msg"), "type": "message", "role": "assistant",
                        "status": "incomplete" if finish == "length" else "completed",
                        "content": [_text_part(message["content"] or "", None if lps is None else lps["content"])]})
        out += [{"id": _item_id("fc"), "type": "function_call", "call_id": t["id"], "name": t["function"]["name"],
                 "arguments": t["function"]["arguments"], "status": "completed"} for t in calls]
        return out, finish, reasoning

    def body(self, ordered: list[RequestOutput]) -> bytes:
        [final] = ordered
        output, finish, reasoning = self.output_of(final.outputs[0])
        return _encode_json(self.envelope_of("incomplete" if finish == "length" else "completed", output,
                                             self.usage_of(final, reasoning), finish))

    # -- the event stream --------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[bytes]:
        events = _EventWriter(self.params.logprobs is not None)
        yield events.emit("response.created", response=self.envelope_of("in_progress", [], None))
        yield events.emit("response.in_progress", response=self.envelope_of("in_progress", [], None))
        tracker = DeltaTracker(list(self.group.tracked), self.params)
        final, finish, reasoning = None, None, ""
        try:
            async for out in self.group.outputs():
                final = out
                for d in tracker.deltas(out):
                    delta, finish = self.delta(d)
                    reasoning += delta.get("reasoning_content", "")
                    lps = self.logprobs(d.token_ids, d.logprobs)
                    for chunk in events.feed(delta, None if lps is None else lps["content"]):
                        yield chunk
            for chunk in events.close(finish):
                yield chunk
            status = "incomplete" if finish == "length" else "completed"
            yield events.emit(f"response.{status}", response=self.envelope_of(
                status, events.items, self.usage_of(final, reasoning), finish))
        except Exception as e:  # never end a stream without telling the client why
            if not isinstance(e, errors.APIError):
                log.exception("stream %s failed", self.id)
                e = errors.internal(f"internal error: {e!r}")
            err = self.client.metrics.error_body(e)["error"]
            yield events.emit("error", code=err["code"], message=err["message"], param=err["param"])


class _EventWriter:
    """Chat deltas -> Responses events: opens and closes the output items as the kind of output changes."""

    def __init__(self, logprobs: bool):
        self.logprobs = logprobs  # message parts carry logprobs (include: message.output_text.logprobs)
        self.seq = 0
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._text = ""  # its text (message, reasoning) or arguments (call)
        self._logprobs: list = []
        self._calls: dict[int, int] = {}  # the chat delta's tool-call index -> output index

    def emit(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _event(body)

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict, part: dict | None) -> list[bytes]:
        out = self.close(None)
        self.items.append(item)
        self._open, self._text, self._logprobs = item, "", []
        out.append(self.emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if part is not None:
            out.append(self.emit("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def feed(self, delta: dict, logprobs: list | None) -> list[bytes]:
        out: list[bytes] = []
        if thought := delta.get("reasoning_content"):
            if self._open is None or self._open["type"] != "reasoning":
                out += self._start({"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                    "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
            self._text += thought
            out.append(self.emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=thought))
        if text := delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                out += self._start({"id": _item_id("msg"), "type": "message", "role": "assistant", "content": [],
                                    "status": "in_progress"}, _text_part("", [] if self.logprobs else None))
            self._text += text
            self._logprobs += logprobs or []
            out.append(self.emit("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                 logprobs=logprobs or []))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call: its id and name come first
                out += self._start({"id": _item_id("fc"), "type": "function_call", "call_id": call["id"],
                                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}, None)
                self._calls[call["index"]] = len(self.items) - 1
            args = call["function"].get("arguments", "")
            if args and self._calls.get(call["index"]) == len(self.items) - 1:
                self._text += args
                out.append(self.emit("response.function_call_arguments.delta", **self._where(), delta=args))
        return out

    def close(self, finish: str | None) -> list[bytes]:
        """Close the open item; at the end (``finish`` given) an output of nothing is an empty message."""
        out = []
        if finish is not None and not self.items:
            out += self._start({"id": _item_id("msg"), "type": "message", "role": "assistant", "content": [],
                                "status": "in_progress"}, _text_part("", [] if self.logprobs else None))
        item, self._open = self._open, None
        if item is None:
            return out
        index, where = len(self.items) - 1, {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self._text}
            out.append(self.emit("response.reasoning_text.done", **where, content_index=0, text=self._text))
            out.append(self.emit("response.content_part.done", **where, content_index=0, part=part))
            item.update(content=[part], status="completed")
        elif item["type"] == "message":
            part = _text_part(self._text, self._logprobs if self.logprobs else None)
            out.append(self.emit("response.output_text.done", **where, content_index=0, text=self._text,
                                 logprobs=self._logprobs))
            out.append(self.emit("response.content_part.done", **where, content_index=0, part=part))
            item.update(content=[part], status="incomplete" if finish == "length" else "completed")
        else:
            out.append(self.emit("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=self._text))
            item.update(arguments=self._text, status="completed")
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        return out
