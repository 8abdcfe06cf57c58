"""From a validated request body to engine work, and from engine outputs to OpenAI JSON.

``prepare_*`` tokenize and check everything that can be checked before the 200 header
(prompt length, stop token ids, max_tokens room); ``Completions`` (server/completions.py),
``Chat`` and ``Generate`` turn the cumulative ``RequestOutput``s of a ``RequestGroup`` into a
response body or a stream of SSE chunks. A failure after the header is an SSE
``{"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec

from expresslane.engine.detokenizer import IncrementalDetokenizer
from expresslane.engine.inputs import InputError
from expresslane.outputs import CompletionOutput, RequestOutput
from expresslane.sampling_params import SamplingParams
from expresslane.server import errors, harmony
from expresslane.server.echo import prompt_logprobs_field
from expresslane.server.engine_client import EngineClient
from expresslane.server.limits import RequestLimits, check_chars, check_counts
from expresslane.server.memory import LARGE_ITEMS, trim_soon
from expresslane.server.reasoning import ReasoningStream, grammar_after_thinking
from expresslane.server.reasoning import split as split_reasoning
from expresslane.server.tools import CallStream, ToolMode, call_id
from expresslane.server.tracker import RequestGroup, TopLogprobs
from expresslane.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerateRequest

log = logging.getLogger(__name__)

# ChatML, for models whose tokenizer has no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

Prompt = tuple[str | None, list[int]]
_encode_json = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def _encoded(choice: dict) -> msgspec.Raw:
    """A response's choice as JSON right away: its logprobs' dicts and floats are freed before the
    next choice is built, rather than all of them living until the whole body is encoded."""
    return msgspec.Raw(_encode_json(choice))


def sse(obj: dict) -> bytes:
    return b"data: " + _encode_json(obj) + b"\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- requests -> engine work --------------------------------------------------------------------
def check_prompt(client: EngineClient, ids: list[int], params: SamplingParams, param: str,
                 clamp: bool = False) -> None:
    """``clamp``: max_tokens is a default (the generation config's): the engine stops at the context."""
    try:
        client.inputs.check(ids, params)
    except InputError as e:  # `param`: where the prompt came from (prompt, messages)
        raise errors.bad_request(str(e), e.field(param), e.code) from None
    limit = client.max_model_len
    if params.max_tokens is not None and not clamp and len(ids) + params.max_tokens > limit:
        raise errors.context_too_long(
            f"this model's maximum context length is {limit} tokens; the request asks for "
            f"{len(ids) + params.max_tokens} ({len(ids)} in the prompt, {params.max_tokens} for the completion)",
            "max_tokens")


def _max_chars(client: EngineClient, limits: RequestLimits) -> int:
    return client.max_prompt_chars if limits.max_prompt_chars is None else limits.max_prompt_chars


def check_prompt_chars(client: EngineClient, limits: RequestLimits, lengths: list[int], param: str,
                       truncation: int | None) -> None:
    """Prompts refused by their characters before tokenizing, unless they are to be cut to their
    last tokens (truncate_prompt_tokens: they may be longer than the context; the body's limit
    bounds them)."""
    if truncation is None:
        check_chars(lengths, _max_chars(client, limits), client.max_model_len, param)


def tokenized(client: EngineClient, prompt: Prompt, params: SamplingParams, param: str) -> tuple[str | None, list[int]]:
    """A prompt's text and token ids, cut to `params.truncate_prompt_tokens`; errors name `param`
    (or truncate_prompt_tokens)."""
    try:
        return client.inputs.truncate(*client.inputs.tokenize(prompt), params.truncate_prompt_tokens)
    except InputError as e:
        raise errors.bad_request(str(e), e.field(param), e.code) from None


def prepare_completion(client: EngineClient, req: CompletionRequest,
                       limits: RequestLimits) -> tuple[list[Prompt], SamplingParams]:
    raw = req.prompts()
    check_counts(limits, stop=req.stop, n=req.n, num_prompts=len(raw), logprobs=req.logprobs, logprobs_param="logprobs")
    check_counts(limits, stop=None, n=1, num_prompts=1, logprobs=req.prompt_logprobs, logprobs_param="prompt_logprobs")
    check_prompt_chars(client, limits, [len(p) for p in raw if isinstance(p, str)], "prompt", req.truncate_prompt_tokens)
    if req.max_tokens == 0 and not req.echo:
        raise errors.bad_request("'max_tokens' must be at least 1 (0 only with echo: true)", "max_tokens")
    if req.echo_only and req.min_tokens:
        raise errors.bad_request("'min_tokens' must be 0 with max_tokens 0", "min_tokens")
    # echo with max_tokens 0: the engine samples one token, which the response leaves out (server/echo.py)
    params = req.sampling_params(1 if req.echo_only else req.max_tokens, req.logprobs, req.engine_prompt_logprobs,
                                 client.sampling_defaults)
    clamp = not req.sets_max_tokens and "max_tokens" in client.sampling_defaults
    prompts = []
    for p in raw:
        text, ids = tokenized(client, p, params, "prompt")
        check_prompt(client, ids, params, "prompt", clamp)
        prompts.append((text, ids))
    return prompts, params


def template_text(tokenizer, template: str | None) -> str:
    """The chat template a prompt is rendered with: ``template``, else the model's, else ChatML."""
    return template or tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE


def chat_prompt(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                tools: list[dict] | None = None, template: str | None = None, template_kwargs: dict | None = None,
                continue_final_message: bool = False) -> Prompt:
    """The chat template (``template``, else the model's, else ChatML) -> text and its token ids."""
    msgs = [m.for_template() for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            msgs, chat_template=template_text(tokenizer, template), tools=tools,
            tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except Exception as e:  # jinja's TemplateError, or a template's own raise_exception()
        raise errors.bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    # The template writes the special tokens (BOS) itself; do not add them twice.
    return text, tokenizer.encode(text, add_special_tokens=False)


def reasoning_kwargs(req: ChatCompletionRequest, template: str, reasoning_parser: str | None) -> dict | None:
    """The template's variables with ``reasoning_effort``: taken by a template that reads it (gpt-oss's
    Reasoning line) or by a reasoning model (--reasoning-parser), where "none" also turns Qwen3's
    thinking off (templates without the switch ignore it)."""
    effort, kwargs = req.reasoning_effort, req.chat_template_kwargs
    if effort is None:
        return kwargs
    if "reasoning_effort" not in template and reasoning_parser is None:
        raise errors.bad_request("'reasoning_effort' needs a reasoning model (serve --reasoning-parser) or a chat "
                                 "template that reads it", "reasoning_effort")
    if (kwargs or {}).get("reasoning_effort", effort) != effort:
        raise errors.bad_request("'reasoning_effort' and chat_template_kwargs.reasoning_effort differ",
                                 "reasoning_effort")
    return {**(kwargs or {}), "reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}


def prepare_chat(client: EngineClient, req: ChatCompletionRequest, limits: RequestLimits,
                 tools: ToolMode | None = None, template: str | None = None,
                 reasoning: str | None = None, shown_tools: list[dict] | None = None,
                 reasoning_parser: str | None = None) -> tuple[list[Prompt], SamplingParams]:
    """``template``: the server's --chat-template (a request's own ``chat_template`` comes first);
    ``reasoning``: the parser after whose thinking a grammar holds the answer; ``reasoning_parser``:
    --reasoning-parser; ``shown_tools``: the tools the template gets when ``tools`` calls for none
    (tool_choice none)."""
    check_counts(limits, stop=req.stop, n=req.n, num_prompts=1, logprobs=req.top_logprobs,
                 logprobs_param="top_logprobs")
    check_counts(limits, stop=None, n=1, num_prompts=1, logprobs=req.prompt_logprobs, logprobs_param="prompt_logprobs")
    check_prompt_chars(client, limits, [sum(len(m.text()) for m in req.messages)], "messages",
                       req.truncate_prompt_tokens)
    params = req.sampling_params(req.max_completion_tokens or req.max_tokens, req.num_logprobs, req.prompt_logprobs,
                                 client.sampling_defaults)
    if tools is not None and (constraint := tools.constraint()) is not None:
        params = dataclasses.replace(params, structured_outputs=constraint)
    template = req.chat_template or template
    kwargs = reasoning_kwargs(req, template_text(client.tokenizer, template), reasoning_parser)
    text, ids = chat_prompt(client.tokenizer, req.messages, req.add_generation_prompt,
                            tools.tools if tools is not None else shown_tools, template, kwargs,
                            req.continue_final_message)
    if reasoning is not None:
        params = grammar_after_thinking(params, text, client.tokenizer, reasoning)
    text, ids = tokenized(client, {"prompt_token_ids": ids, "prompt": text}, params, "messages")
    check_prompt(client, ids, params, "messages", not req.sets_max_tokens and "max_tokens" in client.sampling_defaults)
    return [(text, ids)], params


def prepare_generate(client: EngineClient, req: GenerateRequest,
                     limits: RequestLimits) -> tuple[list[Prompt], SamplingParams]:
    check_counts(limits, stop=req.stop, n=req.n, num_prompts=1, logprobs=None, logprobs_param="logprobs")
    if isinstance(req.prompt, str):
        check_prompt_chars(client, limits, [len(req.prompt)], "prompt", req.truncate_prompt_tokens)
    params = req.sampling_params(req.max_tokens, None, defaults=client.sampling_defaults)
    p = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
    text, ids = tokenized(client, p, params, "prompt")
    check_prompt(client, ids, params, "prompt", not req.sets_max_tokens and "max_tokens" in client.sampling_defaults)
    return [(text, ids)], params


# -- engine outputs -> responses ----------------------------------------------------------------
def usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


def request_metrics(group: RequestGroup, finals: list[RequestOutput]) -> dict | list[dict]:
    """The engine's monotonic timestamps (``return_metrics``): one dict, or a list for several prompts.

    ``engine_arrival_time`` is when the engine process took the request, so
    ``first_token_time - engine_arrival_time`` is the engine's own TTFT, and anything a
    client sees beyond it is server overhead (HTTP, JSON, tokenization, IPC, SSE).
    """
    out = []
    for o in finals:
        m = o.metrics
        row = {"arrival_time": m.arrival_time, "engine_arrival_time": group.engine_arrival_time(o.request_id),
               "first_scheduled_time": m.first_scheduled_time, "first_token_time": m.first_token_time,
               "finished_time": m.finished_time}
        # the latency breakdown, in seconds: waiting for a seat, prompt processing, generation
        row.update(queue_time=_span(m.arrival_time, m.first_scheduled_time),
                   prefill_time=_span(m.first_scheduled_time, m.first_token_time),
                   decode_time=_span(m.first_token_time, m.finished_time))
        out.append(row)
    return out[0] if len(out) == 1 else out


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass(slots=True)
class Delta:
    """What one completion gained since the last chunk."""

    index: int  # choice index: prompt_index * n + completion index
    text: str
    token_ids: list[int]
    logprobs: list[TopLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    output: RequestOutput | None = None  # on a choice's first delta: its prompt's (echo)


@dataclass(slots=True)
class _Sent:
    chars: int = 0
    tokens: int = 0
    done: bool = False
    opened: bool = False  # its first delta has gone out


@dataclass
class DeltaTracker:
    """Cumulative outputs -> deltas per choice.

    While a completion runs, the last ``longest stop string - 1`` characters are held
    back: a stop string completed by a later token cuts the text there, and text
    already sent cannot be taken back.
    """

    request_ids: list[str]
    params: SamplingParams
    sent: dict[tuple[str, int], _Sent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.params.stop), default=1) - 1
        self._prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}

    def deltas(self, out: RequestOutput) -> list[Delta]:
        if self.params.prompt_logprobs is not None and out.prompt_logprobs is None:
            return []  # (n > 1: a sibling may be ahead of the one that scores the prompt) a later output has them
        result = []
        for comp in out.outputs:
            s = self.sent.setdefault((out.request_id, comp.index), _Sent())
            if s.done:
                continue
            end = len(comp.text) if comp.finished else max(s.chars, len(comp.text) - self._holdback)
            text, s.chars = comp.text[s.chars:end], end
            tokens = comp.token_ids[s.tokens:]
            lps = None if comp.logprobs is None else comp.logprobs[s.tokens:len(comp.token_ids)]
            if not (text or comp.finished):
                continue  # keep its tokens (and their logprobs) for the chunk that carries their text
            first, s.opened = not s.opened, True
            s.tokens, s.done = len(comp.token_ids), comp.finished
            result.append(Delta(self._prompt_index[out.request_id] * self.params.n + comp.index, text, tokens,
                                lps, comp.finish_reason, comp.stop_reason, out if first else None))
        return result


class _Endpoint:
    """Shared streaming and collecting; subclasses say what a chunk and a response look like."""

    chunk_object = ""

    def __init__(self, client: EngineClient, model_name: str, request_id: str, group: RequestGroup,
                 params: SamplingParams, include_usage: bool, return_metrics: bool, continuous_usage: bool = False):
        self.client, self.model_name, self.id, self.group = client, model_name, request_id, group
        self.params, self.include_usage, self.return_metrics = params, include_usage, return_metrics
        self.continuous_usage = continuous_usage  # stream_options.continuous_usage_stats (vLLM's)
        self.created = int(time.time())

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "choices": choices}

    async def stream(self) -> AsyncIterator[bytes]:
        finals: dict[str, RequestOutput] = {}
        tracker = DeltaTracker(list(self.group.tracked), self.params)
        usage_field = {"usage": None} if self.include_usage else {}
        try:
            async for out in self.group.outputs():
                if not finals:  # the chat role chunk goes with the first token, as vLLM's does
                    for chunk in self.opening_chunks():
                        yield sse({**chunk, **usage_field})
                finals[out.request_id] = out
                deltas = tracker.deltas(out)
                for i, d in enumerate(deltas):
                    chunk = {**self.chunk(d), **usage_field}
                    if self.continuous_usage:  # the usage so far, in every chunk
                        chunk["usage"] = self.count_usage(list(finals.values()))
                    # Completions are live objects: judge "last" by them, not by the queued snapshot.
                    if (self.return_metrics and not self.include_usage and i == len(deltas) - 1
                            and len(finals) == len(self.group.tracked)
                            and all(c.finished for o in finals.values() for c in o.outputs)):
                        chunk["metrics"] = request_metrics(self.group, self.ordered(finals))
                    yield sse(chunk)
            if self.include_usage:
                chunk = self.usage_chunk(self.count_usage(self.ordered(finals)))
                if self.return_metrics:
                    chunk["metrics"] = request_metrics(self.group, self.ordered(finals))
                yield sse(chunk)
        except Exception as e:  # never end a stream without telling the client why
            if not isinstance(e, errors.APIError):
                log.exception("stream %s failed", self.id)
                e = errors.internal(f"internal error: {e!r}")
            yield sse(self.client.metrics.error_body(e))
        if self.items(finals.values()) > LARGE_ITEMS:
            finals.clear()
            trim_soon()
        yield DONE

    def ordered(self, finals: dict[str, RequestOutput]) -> list[RequestOutput]:
        return [finals[rid] for rid in self.group.tracked]

    async def collect(self) -> bytes:
        """The whole response as JSON; a large one (many tokens × logprobs) is built off the event loop."""
        finals: dict[str, RequestOutput] = {}
        async for out in self.group.outputs():
            finals[out.request_id] = out
        ordered = self.ordered(finals)
        if self.items(ordered) <= LARGE_ITEMS:
            return self.body(ordered)
        body = await asyncio.to_thread(self.body, ordered)
        finals.clear()
        ordered.clear()
        trim_soon()  # after the locals above are freed: the task starts on the loop's next turn
        return body

    def items(self, finals) -> int:
        """Tokens × (1 + logprobs) of a response: what its size and its garbage scale with."""
        prompts = 0 if self.params.prompt_logprobs is None else \
            sum(len(o.prompt_token_ids) for o in finals) * (1 + self.params.prompt_logprobs)
        return sum(len(c.token_ids) for o in finals for c in o.outputs) * (1 + (self.params.logprobs or 0)) + prompts

    def count_usage(self, finals: list[RequestOutput]) -> dict:
        return usage(finals)

    def body(self, ordered: list[RequestOutput]) -> bytes:
        body = self.response(ordered)
        body["usage"] = self.count_usage(ordered)
        if self.return_metrics:
            body["metrics"] = request_metrics(self.group, ordered)
        return _encode_json(body)

    def choice_index(self, prompt_index: int, comp: CompletionOutput) -> int:
        return prompt_index * self.params.n + comp.index

    def opening_chunks(self) -> list[dict]:
        return []

    def usage_chunk(self, u: dict) -> dict:
        return {**self.envelope(self.chunk_object, []), "usage": u}


class Chat(_Endpoint):
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: ToolMode | None = None, reasoning: str | None = None, harmony: bool = False,
                 continued: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = tools  # tool calling (server/tools.py); None: the text is the answer
        # --reasoning-parser (server/reasoning.py); None: no thinking to split off (harmony's: below)
        self.reasoning = None if reasoning == "openai_gptoss" else reasoning
        # gpt-oss (server/harmony.py): channels split the output, unless a grammar holds a forced call
        self.harmony = harmony and (tools is None or tools.choice == "auto")
        # a continued final message: the output goes on inside the answer's message
        self.harmony_opening = ("final", None) if continued else None
        self._call_streams: dict[int, CallStream] = {}  # per choice index, while streaming
        self._reasoning_streams: dict[int, ReasoningStream] = {}
        # per choice: its split, and its text with the special tokens (decoded as the tokens come)
        self._harmony: dict[int, tuple[harmony.HarmonyStream, IncrementalDetokenizer]] = {}

    def call_stream(self, index: int) -> CallStream:
        if index not in self._call_streams:
            self._call_streams[index] = CallStream(self.tools)
        return self._call_streams[index]

    def opening_chunks(self) -> list[dict]:
        n = len(self.group.tracked) * self.params.n
        return [self.envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]) for i in range(n)]

    def chunk(self, d: Delta) -> dict:
        delta, finish = self.delta(d)
        return self.envelope(self.chunk_object, [{
            "index": d.index, "delta": delta, "logprobs": self.logprobs(d.token_ids, d.logprobs),
            "finish_reason": finish, "stop_reason": d.stop_reason}])

    def delta(self, d: Delta) -> tuple[dict, str | None]:
        """A chunk's ``delta`` (reasoning, content and tool calls split by the parsers) and its finish reason."""
        if self.harmony:
            return self._harmony_delta(d)
        text, thought, finish = d.text, "", d.finish_reason
        if self.reasoning is not None:
            stream = self._reasoning_streams.setdefault(d.index, ReasoningStream(self.reasoning))
            thought, text = stream.feed(text, finish is not None)
        tool_calls: list[dict] = []
        if self.tools is not None:
            calls = self.call_stream(d.index)
            text, tool_calls = calls.feed(text, finish is not None)
            if finish == "stop" and calls.num_calls:
                finish = "tool_calls"
        delta = {**({"reasoning_content": thought} if thought else {}), **({"content": text} if text else {}),
                 **({"tool_calls": tool_calls} if tool_calls else {})}
        return delta, finish

    def _harmony_delta(self, d: Delta) -> tuple[dict, str | None]:
        stream, text = self._harmony.setdefault(d.index, (
            harmony.HarmonyStream(self.harmony_opening), IncrementalDetokenizer(self.client.tokenizer, [], None, skip_special_tokens=False)))
        text.add(d.token_ids)
        thought, content, calls = stream.feed(text.text, d.finish_reason is not None)
        calls = calls if self.tools is not None else []
        first = stream.num_calls - len(calls)
        tool_calls = [{"index": first + i, "id": call_id(), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
        finish = "tool_calls" if d.finish_reason == "stop" and self.tools is not None and stream.num_calls \
            else d.finish_reason
        delta = {**({"reasoning_content": thought} if thought else {}), **({"content": content} if content else {}),
                 **({"tool_calls": tool_calls} if tool_calls else {})}
        return delta, finish

    def _harmony_message(self, c: CompletionOutput) -> tuple[dict, str | None]:
        text = self.client.tokenizer.decode(c.token_ids, skip_special_tokens=False)
        split = harmony.parts(harmony.messages(text, self.harmony_opening))
        message = {"role": "assistant", "reasoning_content": split.reasoning or None, "content": split.content}
        if self.tools is None or not split.calls or c.finish_reason == "length":
            return message, c.finish_reason
        return {**message, "content": split.content or None, "tool_calls": [
            {"id": call_id(), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in split.calls]}, "tool_calls"

    def message(self, c: CompletionOutput) -> tuple[dict, str | None]:
        """The assistant message of a finished completion, and its finish reason."""
        if self.harmony:
            return self._harmony_message(c)
        text, thought = c.text, {}
        if self.reasoning is not None:
            reasoning, text = split_reasoning(self.reasoning, text)
            thought = {"reasoning_content": reasoning}
        if self.tools is None or c.finish_reason == "length":  # a call cut short is not a call
            return {"role": "assistant", **thought, "content": text}, c.finish_reason
        content, calls = self.tools.calls(text)
        if not calls:
            return {"role": "assistant", **thought, "content": text}, c.finish_reason
        return {"role": "assistant", **thought, "content": content, "tool_calls": [
            {"id": call_id(), "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in calls]}, "tool_calls"

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, o in enumerate(finals):
            for c in o.outputs:
                message, finish = self.message(c)
                choices.append(_encoded({"index": self.choice_index(i, c), "message": message,
                                         "logprobs": self.logprobs(c.token_ids, c.logprobs), "finish_reason": finish,
                                         "stop_reason": c.stop_reason}))
        body = self.envelope("chat.completion", choices)
        if self.params.prompt_logprobs is not None:  # vLLM's: the response's, one prompt
            body["prompt_logprobs"] = prompt_logprobs_field(finals[0], self.params.prompt_logprobs)
        return body

    def logprobs(self, token_ids: list[int], lps: list[TopLogprobs] | None) -> dict | None:
        if lps is None:
            return None
        texts = self.client.token_texts
        k = self.params.logprobs or 0

        def entry(t: int, lp: float) -> dict:
            s = texts[t]
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(t, lp.get(t, float("-inf"))),
                             "top_logprobs": [entry(a, b) for a, b in sorted(lp.items(), key=lambda kv: -kv[1])[:k]]}
                            for t, lp in zip(token_ids, lps)]}


class Generate(_Endpoint):
    """/generate: plain text in, text and token ids out (no OpenAI envelope)."""

    def chunk(self, d: Delta) -> dict:
        return {"id": self.id, "text": d.text, "token_ids": d.token_ids, "finish_reason": d.finish_reason}

    def usage_chunk(self, u: dict) -> dict:
        return {"id": self.id, "text": "", "token_ids": [], "finish_reason": None, "usage": u}

    def response(self, finals: list[RequestOutput]) -> dict:
        [o] = finals
        c = o.outputs[0]
        return {"id": self.id, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
