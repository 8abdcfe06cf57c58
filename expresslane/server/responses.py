"""OpenAI's Responses API (``POST /v1/responses``): the request body, and its translation into a chat
completions request, so that tools, grammars and reasoning run through the chat path unchanged.

- ``input`` (a string, or items) and ``instructions`` become chat messages: ``instructions`` the
  first system message; ``function_call`` items join the assistant message before them (or make
  one) as its ``tool_calls``; ``function_call_output`` items become ``tool`` messages;
  ``reasoning`` items are dropped (the template never saw them).
- ``text.format`` becomes ``response_format``; the flat function tools become chat tools.
- The server keeps no responses: ``store: true``, ``previous_response_id``, ``conversation`` and
  ``background: true`` are 400s that say so. ``response_events.py`` writes the response.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from expresslane.server import errors
from expresslane.server.protocol import (
    _BODY, _STRICT, INT32, ChatCompletionRequest, List, NonEmptyStr, parse,
)

# Undeclared fields of OpenAI's, accepted at the value that asks for nothing (any other: a 400 naming it).
RESPONSES_NOOP_FIELDS: dict[str, tuple] = {
    "service_tier": (None, "auto", "default"),
    **{name: (None,) for name in ("prompt", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                                  "max_tool_calls", "context_management", "moderation")},
}
_NO_STORAGE = "this server keeps no responses"
_OUTPUT_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "refusal")


class ContentPart(BaseModel):
    """A message's content part: text only (``input_text``, an echoed ``output_text``, a ``refusal``)."""

    model_config = _STRICT
    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list | None = None  # an echoed output_text's
    logprobs: list | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in _TEXT_PARTS:
            raise ValueError(f"{v!r} is not supported by this server (text only: {', '.join(_TEXT_PARTS)})")
        return v

    @model_validator(mode="after")
    def _has_its_text(self) -> "ContentPart":
        if (self.refusal if self.type == "refusal" else self.text) is None:
            raise ValueError(f"a part of type {self.type!r} needs "
                             f"'{'refusal' if self.type == 'refusal' else 'text'}'")
        return self

    def value(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


def _parts(v):
    """A string content as one text part: then no union of str and parts blurs a part's error."""
    return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


def _text(content: list[ContentPart]) -> str:
    return "".join(p.value() for p in content)


Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: List[ContentPart]
    id: str | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    _content = field_validator("content", mode="before")(_parts)


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str
    id: str | None = None
    status: Status | None = None
    namespace: None = None
    caller: None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: List[ContentPart]
    id: str | None = None
    status: Status | None = None
    name: str | None = None
    namespace: None = None
    caller: None = None

    _output = field_validator("output", mode="before")(_parts)


class ReasoningItem(BaseModel):
    """A previous turn's reasoning, sent back: accepted and left out of the prompt."""

    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list = []
    content: list | None = None
    encrypted_content: str | None = None
    status: Status | None = None


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Tags with a '-': the error's field path leaves them out (protocol._param), so it reads input[0].content.
Item = Annotated[Annotated[MessageItem, Tag("item-message")] | Annotated[FunctionCallItem, Tag("item-function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("item-function_call_output")]
                 | Annotated[ReasoningItem, Tag("item-reasoning")],
                 Discriminator(lambda item: "item-" + (item.get("type") if isinstance(item, dict) else item.type))]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    defer_loading: Literal[False] | None = None


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: NonEmptyStr


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: NonEmptyStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the default; another asks for what this server cannot do


class ReasoningConfig(BaseModel):
    model_config = _STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: None = None  # no summaries are written
    generate_summary: None = None


class ResponsesStreamOptions(BaseModel):
    model_config = _STRICT
    include_obfuscation: Literal[False] = False  # no obfuscation padding is written


def _or_a_string(schema: dict) -> None:
    """/openapi.json: ``input`` may be a string too (the validator makes it one message)."""
    items = dict(schema)
    schema.clear()
    schema["anyOf"] = [{"type": "string"}, items]


class ResponsesRequest(BaseModel):
    model_config = _BODY
    model: str | None = None
    input: Annotated[List[Item], Field(json_schema_extra=_or_a_string)]  # a string is one user message
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: List[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    user: str | None = None  # accepted and not used, as on chat (OpenAI's end-user label)
    safety_identifier: str | None = None  # the same, under OpenAI's newer name
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None  # echoed in the response
    include: List[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # after include: its check reads it
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, v):
        if isinstance(v, str):
            return [{"type": "message", "role": "user", "content": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of items")
        if not v:
            raise ValueError("must not be empty")
        v = list(v)  # the body's own list stays as it came
        for i, item in enumerate(v):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                v[i] = item = {**item, "type": "message"}  # OpenAI's EasyInputMessage has no type
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in _ITEM_TYPES:
                raise ValueError(f"item {i} has type {kind!r}; this server takes {', '.join(_ITEM_TYPES)}"
                                 + (f" ({_NO_STORAGE} to refer to)" if kind == "item_reference" else ""))
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v):
        for i, tool in enumerate(v if isinstance(v, list) else ()):  # not a list: pydantic's error
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} is of type {kind!r}: this server runs function tools only")
        return v

    @field_validator("include")
    @classmethod
    def _honoured(cls, v: list[str] | None) -> list[str] | None:
        for name in v or ():
            if name != _OUTPUT_LOGPROBS:
                raise ValueError(f"{name!r} is not supported by this server (only {_OUTPUT_LOGPROBS!r})")
        return v

    @field_validator("store", "background")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError(f"true is not supported: {_NO_STORAGE} (leave it out or send false)")
        return v

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _nothing_to_continue(cls, v):
        if v is not None:
            raise ValueError(f"is not supported: {_NO_STORAGE}, so send the whole conversation in 'input'")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info) -> int | None:
        if v and _OUTPUT_LOGPROBS not in (info.data.get("include") or ()):
            raise ValueError(f"needs include: [{_OUTPUT_LOGPROBS!r}]")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("is only for streams (stream: true)")
        return v

    @property
    def logprobs(self) -> bool:
        return _OUTPUT_LOGPROBS in (self.include or ())

    def format(self) -> TextFormat:
        return (self.text.format if self.text is not None else None) or TextFormat(type="text")


def parse_responses(body: object) -> ResponsesRequest:
    return parse(ResponsesRequest, body, RESPONSES_NOOP_FIELDS)


def _messages(req: ResponsesRequest) -> list[dict]:
    """``instructions`` and ``input`` as chat messages (OpenAI's message schema)."""
    msgs: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in req.input:
        if isinstance(item, MessageItem):
            msgs.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if msgs and msgs[-1]["role"] == "assistant":  # the calls of one turn: one assistant message
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            msgs.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not msgs:
        raise errors.bad_request("'input' holds no message (reasoning items alone are no prompt)", "input")
    return msgs


def _response_format(fmt: TextFormat) -> dict | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise errors.bad_request("text.format of type json_schema needs 'name' and 'schema'", "text.format")
    return {"type": "json_schema", "json_schema": {
        "name": fmt.name, "schema": fmt.schema_, **({} if fmt.strict is None else {"strict": fmt.strict}),
        **({} if fmt.description is None else {"description": fmt.description})}}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completions request that does this response's work."""
    choice = req.tool_choice
    # A forced call is this turn's whole output, so a text format has nothing to hold (OpenAI takes both;
    # the Agents SDK sends both, then resets tool_choice and the format holds the answer).
    forced = bool(req.tools) and (choice == "required" or isinstance(choice, FunctionChoice))
    body = {
        "model": req.model, "messages": _messages(req), "stream": bool(req.stream),
        "temperature": req.temperature, "top_p": req.top_p,  # null: the chat default
        "max_completion_tokens": req.max_output_tokens, "user": req.user,
        "tools": [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type", "defer_loading"})}
                  for t in req.tools] if req.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice)
        else choice,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "response_format": None if forced else _response_format(req.format()),
        "logprobs": req.logprobs, "top_logprobs": (req.top_logprobs or 0) if req.logprobs else None,
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
    }
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


# chat field -> the Responses field it came from, longest first (for the 400s the chat path raises)
_FROM_CHAT = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
              ("structured_outputs", "text.format"), ("max_completion_tokens", "max_output_tokens"),
              ("max_tokens", "max_output_tokens"), ("messages", "input"), ("reasoning_effort", "reasoning.effort"))


def in_responses_terms(e: errors.APIError, req: ResponsesRequest) -> errors.APIError:
    """A 400 of the chat path, naming the Responses field the client sent instead of the chat one."""
    if e.message.startswith("structured_outputs"):  # the engine's grammar error: the format's schema or a tool's
        e.param = "text.format" if req.format().type != "text" else "tools"
        e.message = e.param + e.message.removeprefix("structured_outputs")
        return e
    for chat, ours in _FROM_CHAT:
        if e.param is not None and (e.param == chat or e.param.startswith((chat + ".", chat + "["))):
            e.message = e.message.replace(chat, ours)
            e.param = ours if chat == "messages" else ours + e.param[len(chat):]  # message numbers differ
            break
    return e
