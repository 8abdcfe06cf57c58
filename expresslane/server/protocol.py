"""Request bodies (pydantic, strict JSON types) and how a validation error becomes a 400.

A body is decoded by msgspec (C, the collector paused) and then validated by pydantic
in strict Python mode: for a large body (256 prompts × 2,047 token ids) that is about a
third of pydantic's own JSON parse, and every list fails at its first bad item, so no
body, however large or wrong, costs more than one pass over it on the event loop.

Field names and defaults follow OpenAI's API; the extras (``top_k``, ``min_p``,
``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``priority``, ``lane``, ...)
follow vLLM. ``return_metrics`` is ours: it adds the engine's timestamps to the
response (see ``serving.request_metrics``). Nothing is silently ignored: a field this
server does not know is refused with a 400 that names it; vLLM's and OpenAI's fields that it
does not implement (``NOOP_FIELDS`` and the penalties) are accepted only at the value that
asks for nothing. docs/api.md lists every field and what it does here.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Annotated, Iterator, Literal, TypeVar

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from expresslane.sampling_params import SamplingParamError, SamplingParams, StructuredOutputs
from expresslane.server.errors import APIError, bad_request

MAX_N = 128  # OpenAI's limit
INT32 = 2**31 - 1  # bound on counts: every integer must fit the engine's wire format (msgpack int64)
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)  # nested objects: unknown fields refused
# Request bodies: `parse` judges the extras (their schema says what they take: no other field).
_BODY = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, json_schema_extra={"additionalProperties": False})

# Fields of vLLM's (and OpenAI's) request bodies that this server does not implement, accepted
# only at a value that asks for nothing (their default): any other value is a 400 naming the
# field. A field neither declared nor listed here is a 400 too. docs/api.md lists them all.
NOOP_FIELDS: dict[str, tuple] = {
    **{name: (None,) for name in (
        "guided_decoding_backend", "guided_whitespace_pattern",
        "logits_processors", "documents", "request_id", "cache_salt",
        "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs", "service_tier",
        "modalities", "audio", "prediction", "web_search_options", "functions",
        "function_call")},
    # OpenAI's own defaults, as its SDK's users send them
    "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "use_beam_search": (False,), "length_penalty": (1.0,), "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
}

NonEmptyStr = Annotated[str, Field(min_length=1)]
# vLLM's truncate_prompt_tokens: keep the prompt's last k tokens; -1: as many as the context holds
def _not_zero(k: int) -> int:
    if k == 0:
        raise ValueError("must be at least 1 (tokens kept), or -1 for the model's context")
    return k


Truncation = Annotated[int, Field(ge=-1, le=INT32), AfterValidator(_not_zero)]
# what a chat template gets from the request itself: chat_template_kwargs may not set these
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                     "chat_template", "tokenize", "return_dict", "conversation"})
T = TypeVar("T")
List = Annotated[list[T], Field(fail_fast=True)]  # every list: the first bad item is the error (pydantic collects all by default)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: NonEmptyStr
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, any JSON object, or JSON that follows a schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    model_config = _STRICT
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: NonEmptyStr | None = None
    choice: List[NonEmptyStr] | None = Field(None, min_length=1)
    grammar: NonEmptyStr | None = None


def _schema_text(schema: dict | str, field: str) -> str:
    """A JSON schema as JSON text; a string must hold a JSON object."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as e:
            raise bad_request(f"'{field}' is not valid JSON: {e}", field) from None
        if not isinstance(schema, dict):
            raise bad_request(f"'{field}' must be a JSON schema (an object)", field)
    return msgspec.json.encode(schema).decode()


class SamplingRequest(BaseModel):
    """Fields shared by /v1/completions, /v1/chat/completions and /generate."""

    model_config = _BODY
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_N)  # child i uses seed + i
    stop: NonEmptyStr | List[NonEmptyStr] | None = None
    stop_token_ids: List[Annotated[int, Field(ge=0, le=INT32)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI sends it, a string) -> bias
    allowed_token_ids: List[Annotated[int, Field(ge=0, le=INT32)]] | None = Field(None, min_length=1)
    bad_words: List[str] | None = None  # vLLM's: words never generated
    truncate_prompt_tokens: Truncation | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=-INT32, le=INT32)  # lower runs first under --scheduling-policy priority
    lane: Literal["interactive", "batch"] | None = None  # None: picked by priority
    return_metrics: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: NonEmptyStr | None = None
    guided_choice: List[NonEmptyStr] | None = Field(None, min_length=1)
    guided_grammar: NonEmptyStr | None = None
    # vLLM's: the top-k at each prompt position and the prompt token's own (the server's --max-logprobs
    # is checked after parsing); not with stream, as vLLM
    prompt_logprobs: int | None = Field(None, ge=0, le=INT32)

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise ValueError("is not available with stream: true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict | None) -> dict | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or int(key) > INT32:
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for {key}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("is only for streams (stream: true)")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def structured(self) -> StructuredOutputs | None:
        """The grammar the output must follow, from whichever field gives one (at most one may)."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", StructuredOutputs(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
            given.append(("response_format", StructuredOutputs(
                json=_schema_text(rf.json_schema.schema_, "response_format.json_schema.schema"))))
        so = self.structured_outputs
        if so is not None:
            fields = {k: v for k, v in (("json", so.json_), ("json_object", so.json_object), ("regex", so.regex),
                                        ("choice", so.choice), ("grammar", so.grammar)) if v is not None and v is not False}
            if len(fields) != 1:
                raise bad_request("structured_outputs must set exactly one of json, json_object, regex, choice and "
                                  f"grammar, got {sorted(fields) or 'none'}", "structured_outputs")
            (name, value), = fields.items()
            if name == "json":
                value = _schema_text(value, "structured_outputs.json")
            given.append(("structured_outputs", StructuredOutputs(**{name: value})))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                value = _schema_text(value, name) if kind == "json" else value
                given.append((name, StructuredOutputs(**{kind: value})))
        if len(given) > 1:
            raise bad_request(f"give one way to constrain the output, not {[n for n, _ in given]}", given[1][0])
        return given[0][1] if given else None

    @property
    def sets_max_tokens(self) -> bool:
        return any(getattr(self, name, None) is not None for name in {"max_tokens", "max_completion_tokens"}
                   & self.model_fields_set)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """`prompt_logprobs`: what the engine computes (the field's, or more for `echo`); `defaults`: the
        generation config's (engine/generation_config.py), for the fields this request leaves out."""
        given = self.model_fields_set
        own = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        own.update((name, value) for name, value in (defaults or {}).items() if name in own and name not in given)
        if defaults and "max_tokens" in defaults and not self.sets_max_tokens:  # vLLM's: the smaller one
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
        try:
            return SamplingParams(
                prompt_logprobs=prompt_logprobs,
                n=self.n, max_tokens=max_tokens, temperature=own["temperature"], top_p=own["top_p"],
                top_k=own["top_k"], min_p=own["min_p"], seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=self.structured(),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=own["repetition_penalty"],
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
                truncate_prompt_tokens=self.truncate_prompt_tokens)
        except SamplingParamError as e:
            raise bad_request(str(e), e.param) from None


class CompletionRequest(SamplingRequest):
    prompt: str | List[str] | List[int] | List[List[int]]
    max_tokens: int | None = Field(16, ge=0, le=INT32)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=INT32)  # the server's --max-logprobs is checked after parsing
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) the logprobs
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: Literal[True] | None = None  # vLLM's default for completions (BOS added); False: not built

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("must not be empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("other than n is not supported by this server")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("is not supported by this server")
        return v

    @property
    def echo_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt alone comes back (the engine samples one token, dropped)."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top-k the engine scores the prompt with: `prompt_logprobs`, or `logprobs` for `echo`."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | dict]:
        """The prompt(s) as ``InputProcessor.tokenize`` takes them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: NonEmptyStr
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """OpenAI's message schema. An assistant message may carry ``tool_calls`` (its ``content``
    then often null), a ``tool`` message answers one by ``tool_call_id``. The fields a client
    echoes back from a response (``refusal``, ``annotations``, ``audio``, ``function_call``) are
    accepted at null (``annotations`` empty too); a ``refusal`` text stands for missing content.
    An assistant's ``reasoning_content`` (a reasoning parser's, echoed back) goes to the template
    as it is (templates that know it decide what of it to show)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | List[TextPart] | None = None
    name: str | None = None
    tool_calls: List[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content if self.content is not None else (self.refusal or "")

    def for_template(self) -> dict:
        """The message as chat templates take it (tool-call arguments as objects, as HF's templates expect)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return out


def _arguments(text: str) -> object:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text  # not JSON: the template gets the text as it came


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    name: NonEmptyStr


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32)  # the server's --max-logprobs is checked after parsing
    add_generation_prompt: bool = True
    tools: List[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_special_tokens: Literal[False] | None = None  # vLLM's default for chat (the template writes BOS)
    chat_template: NonEmptyStr | None = None  # this request's Jinja chat template instead of the model's
    chat_template_kwargs: dict | None = None  # more variables for the template (Qwen3's enable_thinking)
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    # OpenAI's values; the chat template gets it as `reasoning_effort` (gpt-oss: its Reasoning line)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_names(cls, v: dict | None) -> dict | None:
        return template_kwargs(v)

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt", True):
            raise ValueError("needs add_generation_prompt: false")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(SamplingRequest):
    prompt: NonEmptyStr | List[int]
    max_tokens: int | None = Field(16, ge=1, le=INT32)
    n: int = Field(1, ge=1, le=1)
    prompt_logprobs: None = None  # /generate returns text and token ids only


def template_kwargs(v: dict | None) -> dict | None:
    """chat_template_kwargs: none of the names the request's own fields give the template."""
    taken = sorted(set(v or ()) & RESERVED_TEMPLATE_NAMES)
    if taken:
        raise ValueError(f"may not set {taken}: the request's own fields give them")
    return v


class TokenizeRequest(BaseModel):
    model_config = _BODY
    model: str | None = None
    prompt: str | None = None
    messages: List[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _BODY
    model: str | None = None
    tokens: List[int]


_SCALAR_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(item) -> bool:
    """Pydantic names the member of a union in the error location: 'str', 'list[int]', 'function-after[...]'."""
    return isinstance(item, str) and (item in _SCALAR_TAGS or "[" in item or "-" in item)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """A body of many small containers would otherwise cost a collection per 700 of them
    (1.8 s instead of 0.3 s for 16 MiB of empty lists); they are freed by refcount anyway."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def decode(body: bytes) -> object:
    """The JSON body as Python objects, or a 400 ``invalid_json``."""
    with _collector_paused():
        try:
            return msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            raise bad_request(f"the body is not valid JSON: {e}", None, "invalid_json") from None
        except RecursionError:  # msgspec's decoder recurses per nesting level; no request body nests that deep
            raise bad_request("the body nests too deeply to be a request", None, "invalid_json") from None


def parse(model: type[BaseModel], body: bytes | object, noop: dict[str, tuple] = NOOP_FIELDS) -> BaseModel:
    """Validate a body (raw, or already ``decode``d); the first problem becomes a 400 naming its
    field (OpenAI's ``param``). ``noop``: the undeclared fields accepted at the values listed."""
    obj = decode(body) if isinstance(body, bytes) else body
    if not isinstance(obj, dict):
        raise bad_request(f"the body must be a JSON object, not {_json_type(obj)}", None)
    with _collector_paused():
        try:
            req = model.model_validate(obj, strict=True)
        except ValidationError as e:
            raise validation_error(e) from None
    for name, value in (req.model_extra or {}).items():
        accepted = noop.get(name)
        if accepted is None:
            raise bad_request(f"unknown field '{name}': this server does not take it (docs/api.md lists the fields "
                              "it takes)", name, "unknown_field")
        if value not in accepted:
            raise bad_request(f"'{name}' is not supported by this server (only {accepted[0]!r})", name)
    return req


def _json_type(obj: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(obj), "a number")


def validation_error(e: ValidationError) -> APIError:
    errs = e.errors(include_url=False)
    first = errs[0]
    if not first["loc"]:
        return bad_request(first["msg"], None)
    param = _param(first["loc"])
    k = next((i for i, item in enumerate(first["loc"]) if _is_union_tag(item)), None)
    if k is not None:  # a union: no single member's message is the right one, so list the members
        prefix = first["loc"][:k]
        members = [err["loc"][k] for err in errs
                   if err["loc"][:k] == prefix and len(err["loc"]) > k and _is_union_tag(err["loc"][k])]
        if len(set(members)) > 1:
            expected = ", ".join(dict.fromkeys(members)).replace("constrained-str", "non-empty str")
            return bad_request(f"'{_param(prefix)}' has an invalid type or value; expected one of: {expected}",
                               _param(prefix))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return bad_request(f"'{param}' is required", param, "missing_required_parameter")
    return bad_request(f"'{param}' {msg}" if msg.startswith("is ") or msg.startswith("must ")
                       else f"'{param}': {msg}", param)


def _param(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union member tags ('list[str]') are dropped."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif not _is_union_tag(item):
            out += f".{item}" if out else item
    return out
