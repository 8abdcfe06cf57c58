"""gpt-oss's output in the harmony format (models/harmony.py), split into the chat message's
parts: `analysis` -> ``reasoning_content``, `final` (and `commentary` without a recipient, the
model's preambles) -> ``content``, `commentary` to ``functions.NAME`` -> a tool call with the
message as its arguments. On with ``--reasoning-parser openai_gptoss`` or ``--tool-call-parser
openai``, or by itself when the chat template is harmony (vLLM's flags, picked as the other
families' parsers are).

The output is read as text decoded with its special tokens, so a marker counts whether the
model wrote it as its special token or spelled it out. It starts inside a message header: the
prompt ends with ``<|start|>assistant``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from expresslane.models.harmony import CALL, CHANNEL, CONSTRAIN, END, ENDOFTEXT, MESSAGE, RETURN, START
from expresslane.server.tools import ToolCallOut

_BODY_END = re.compile("|".join(re.escape(t) for t in (END, RETURN, CALL, ENDOFTEXT)))
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)
_FUNCTIONS = "functions."


@dataclass(frozen=True, slots=True)
class Message:
    channel: str
    recipient: str | None
    content: str
    done: bool  # its end marker was written


def messages(text: str) -> list[Message]:
    """The messages of an assistant's output, the last one possibly unfinished (a header not
    yet closed by ``<|message|>`` is left out)."""
    out: list[Message] = []
    pos = 0
    while True:
        body = text.find(MESSAGE, pos)
        if body < 0:
            return out
        channel, recipient = _header(text[pos:body])
        body += len(MESSAGE)
        end = _BODY_END.search(text, body)
        out.append(Message(channel, recipient, text[body:end.start() if end else len(text)], end is not None))
        if end is None:
            return out
        pos = end.end()
        if text.startswith(START, pos):
            pos += len(START)


def _header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of e.g. ``assistant<|channel|>commentary to=functions.f <|constrain|>json``."""
    header = header.split(CONSTRAIN)[0]
    role, _, channel = header.partition(CHANNEL)
    words = (role + " " + channel).split()
    recipient = next((w[3:] for w in words if w.startswith("to=")), None)
    names = channel.split()
    return (names[0] if names else ""), recipient


@dataclass(frozen=True, slots=True)
class Parts:
    reasoning: str
    content: str
    calls: list[ToolCallOut]


def parts(msgs: list[Message]) -> Parts:
    """The messages as reasoning, content and tool calls (an unfinished call is not one yet)."""
    reasoning, content, calls = [], [], []
    for m in msgs:
        if m.recipient is not None and m.recipient.startswith(_FUNCTIONS):
            if m.done:
                calls.append(ToolCallOut(m.recipient[len(_FUNCTIONS):], m.content.strip()))
        elif m.channel == "analysis":
            reasoning.append(m.content)
        else:
            content.append(m.content)
    return Parts("\n".join(reasoning), "\n".join(content), calls)


def enabled(reasoning_parser: str | None, tool_call_parser: str, template: str | None) -> bool:
    """Whether a chat's output is read as harmony: asked for, or the parsers left to pick and the
    chat template writes harmony."""
    if reasoning_parser == "openai_gptoss" or tool_call_parser == "openai":
        return True
    return reasoning_parser is None and tool_call_parser == "auto" and CHANNEL in (template or "")


def held(text: str) -> int:
    """Characters at the end that may be the start of a marker (spelled out, not yet whole)."""
    for k in range(min(max(map(len, _MARKERS)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in _MARKERS):
            return k
    return 0


class HarmonyStream:
    """One choice's output as (reasoning, content, tool calls) deltas: the split of the text so
    far (less an end that may become a marker) minus what was sent; each call whole once its
    message ends."""

    def __init__(self):
        self.text = ""
        self.num_calls = 0
        self._reasoning_sent = self._content_sent = 0

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallOut]]:
        """`text`: the whole output so far, special tokens included."""
        self.text = text
        split = parts(messages(text if finished else text[:len(text) - held(text)]))
        out = (split.reasoning[self._reasoning_sent:], split.content[self._content_sent:],
               split.calls[self.num_calls:])
        self._reasoning_sent = max(self._reasoning_sent, len(split.reasoning))
        self._content_sent = max(self._content_sent, len(split.content))
        self.num_calls = max(self.num_calls, len(split.calls))
        return out
