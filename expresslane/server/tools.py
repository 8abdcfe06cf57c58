"""Tool calling: what ``tool_choice`` makes the model write, and the calls read back out.

- ``required`` and a named function are enforced by a grammar (structured outputs): a named
  call's output is its arguments object (the function's ``parameters`` schema); a required
  one's is a JSON array of ``{"name": ..., "parameters": {...}}`` over the offered tools (one
  item when ``parallel_tool_calls`` is false). Even a weak model then returns well-formed calls
  whose arguments validate against the tool's schema.
- ``auto``: the model writes what it likes; a tool-call parser for its family reads calls out of
  the text (``--tool-call-parser``; ``auto`` picks by the chat template): ``hermes``
  (``<tool_call>{...}</tool_call>``: Hermes, Qwen2.5, Qwen3), ``llama3_json`` (a JSON object
  with ``name`` and ``parameters``), ``mistral`` (``[TOOL_CALLS]`` and a JSON array).
- ``none`` (or no tools): the text is the answer; no calls are read out of it.

Tools reach the chat template (``tools=``), with ``none`` too (vLLM's and OpenAI's; not with
``--exclude-tools-when-tool-choice-none``); history messages' calls go back to it too.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from expresslane.sampling_params import StructuredOutputs
from expresslane.server import errors
from expresslane.server.protocol import ChatCompletionRequest, NamedToolChoice

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_EMPTY_OBJECT = {"type": "object"}
_ARGS_START = re.compile(r'"parameters"\s*:\s*\{$')


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    name: str
    arguments: str  # JSON text


def _parse_json(text: str) -> object | None:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj: object, args_key: str) -> ToolCallOut | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCallOut(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCallOut]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = [c for m in _HERMES.finditer(text, start) if (c := _call(_parse_json(m.group(1)), "arguments"))]
    if not calls:
        return text, []
    return text[:start].strip() or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCallOut]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [c for part in body.split(";") if (c := _call(_parse_json(part.strip()), "parameters"))]
    return (None, calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str | None, list[ToolCallOut]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    items = _parse_json(text[start + len("[TOOL_CALLS]"):].strip())
    items = items if isinstance(items, list) else [items]
    calls = [c for item in items if (c := _call(item, "arguments"))]
    return (text[:start].strip() or None, calls) if calls else (text, [])


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def parser_for_template(template: str | None) -> str:
    """The tool-call parser a chat template's format calls for (hermes where it names none)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolMode:
    """One chat request's tool calling: ``choice`` is auto, required or named."""

    choice: str
    tools: list[dict]  # as the chat template takes them (OpenAI's shape)
    named: str | None = None
    parser: str = "hermes"
    parallel: bool = True

    def constraint(self) -> StructuredOutputs | None:
        by_name = {t["function"]["name"]: t["function"].get("parameters") or _EMPTY_OBJECT for t in self.tools}
        if self.choice == "named":
            return StructuredOutputs(json=json.dumps(by_name[self.named]))
        if self.choice == "required":
            item = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                               "required": ["name", "parameters"], "additionalProperties": False}
                              for name, schema in by_name.items()]}
            array = {"type": "array", "items": item, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
            return StructuredOutputs(json=json.dumps(array))
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """(the content left, the calls) read out of a finished completion's text."""
        if self.choice == "named":
            return None, [ToolCallOut(self.named, text)]
        if self.choice == "required":
            items = _parse_json(text)
            calls = [c for item in items if (c := _call(item, "parameters"))] if isinstance(items, list) else []
            return (None, calls) if calls else (text, [])
        return PARSERS[self.parser](text)


def template_tools(req: ChatCompletionRequest, exclude_when_none: bool = False) -> list[dict] | None:
    """The tools the chat template gets: the request's, unless ``tool_choice`` is none and the
    server excludes them then."""
    if not req.tools or (exclude_when_none and req.tool_choice == "none"):
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def tool_mode(req: ChatCompletionRequest, parser: str, template: str | None) -> ToolMode | None:
    """The request's tool calling, checked (400s name the field); None: the text is the answer."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise errors.bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise errors.bad_request("tools: two functions have the same name", "tools")
    if (choice in ("required",) or isinstance(choice, NamedToolChoice)) and req.structured() is not None:
        raise errors.bad_request("tool_choice required or named and a response_format or structured_outputs "
                                 "cannot both constrain the output", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise errors.bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                     f"({', '.join(names)})", "tool_choice")
        return ToolMode("named", tools, choice.function.name, parallel=req.parallel_tool_calls)
    chosen = parser_for_template(template) if parser == "auto" else parser
    return ToolMode(choice or "auto", tools, parser=chosen, parallel=req.parallel_tool_calls)


class CallStream:
    """One choice's text, streamed as tool-call deltas (OpenAI's ``delta.tool_calls``).

    - named: the text is the arguments: each piece goes out as it comes.
    - required: the grammar writes ``[{"name": "N", "parameters": {...}}, ...]``; a small scanner sends each call's id and name once its name is complete, then its arguments'
      characters as they come.
    - auto: text before a call streams as content; from the parser's opening tag on it is held,
      and each call goes out whole when its text closes (or at the end).
    """

    def __init__(self, mode: ToolMode):
        self.mode = mode
        self.text = ""
        self.num_calls = 0
        self._content_sent = 0  # auto: characters of content sent
        self._depth = 0  # required: nesting depth (strings excluded)
        self._in_string = self._escaped = False
        self._item = ""  # required: the current item's text before its arguments
        self._in_args = False

    def feed(self, piece: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) for the next piece of text."""
        self.text += piece
        if self.mode.choice == "named":
            return "", self._named(piece)
        if self.mode.choice == "required":
            return "", self._required(piece)
        return self._auto(finished)

    def _header(self, name: str, arguments: str = "") -> dict:
        delta = {"index": self.num_calls, "id": call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        self.num_calls += 1
        return delta

    def _named(self, piece: str) -> list[dict]:
        if self.num_calls == 0:
            return [self._header(self.mode.named, piece)]
        return [{"index": 0, "function": {"arguments": piece}}] if piece else []

    def _required(self, piece: str) -> list[dict]:
        out: list[dict] = []
        args = ""
        for ch in piece:
            if self._in_args:
                args += ch
            elif self._depth >= 2:
                self._item += ch
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
                if self._depth == 2:
                    self._item = ch
                elif self._depth == 3 and not self._in_args and (m := _ARGS_START.search(self._item)):
                    name = _parse_json(self._item[:m.start()].rstrip().rstrip(",") + "}")
                    if args:
                        out.append({"index": self.num_calls - 1, "function": {"arguments": args}})
                    out.append(self._header(name.get("name", "") if isinstance(name, dict) else "", "{"))
                    self._in_args, args = True, ""
            elif ch in "}]":
                self._depth -= 1
                if self._in_args and self._depth == 2:
                    out.append({"index": self.num_calls - 1, "function": {"arguments": args}})
                    self._in_args, args = False, ""
        if self._in_args and args:
            out.append({"index": self.num_calls - 1, "function": {"arguments": args}})
        return out

    def _auto(self, finished: bool) -> tuple[str, list[dict]]:
        tag = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "{"}[self.mode.parser]
        start = self.text.find(tag)
        if start < 0:  # all content, but a possible start of the tag stays back
            keep = 0 if finished else next((k for k in range(min(len(tag), len(self.text)), 0, -1)
                                            if tag.startswith(self.text[-k:])), 0)
            if self.mode.parser == "llama3_json" and self.text.strip() == "":
                keep = len(self.text)
            end = len(self.text) - keep
            content, self._content_sent = self.text[self._content_sent:end], max(self._content_sent, end)
            return content, []
        content = self.text[self._content_sent:start]
        self._content_sent = max(self._content_sent, start)
        _, calls = PARSERS[self.mode.parser](self.text)
        complete = calls if finished else calls[:self._closed_calls()]
        out = [self._header(c.name, c.arguments) for c in complete[self.num_calls:]]
        return content if self.mode.parser != "llama3_json" else "", out

    def _closed_calls(self) -> int:
        if self.mode.parser == "hermes":
            return self.text.count("</tool_call>")
        return 0  # llama3_json and mistral: whole at the end
