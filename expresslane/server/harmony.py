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
from collections.abc import Iterator
from dataclasses import dataclass

from expresslane.models.harmony import CALL, CHANNEL, CONSTRAIN, END, ENDOFTEXT, MESSAGE, RETURN, START
from expresslane.server.tools import ToolCallOut

_BODY_END = re.compile("|".join(re.escape(t) for t in (END, RETURN, CALL, ENDOFTEXT)))
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)
_LONGEST = max(map(len, _MARKERS))
_FUNCTIONS = "functions."


@dataclass(frozen=True, slots=True)
class Message:
    channel: str
    recipient: str | None
    content: str
    done: bool  # its end marker was written


def messages(text: str, opening: tuple[str, str | None] | None = None) -> list[Message]:
    """The messages of an assistant's output, the last one possibly unfinished (a header not
    yet closed by ``<|message|>`` is left out); `opening`: the (channel, recipient) of a message
    the prompt left open, which the output goes on with."""
    return [m for m, _ in _scan(text, 0, opening)]


def _scan(text: str, pos: int, opening: tuple[str, str | None] | None = None) -> Iterator[tuple[Message, int]]:
    """The messages from `pos` on, each with where the text after it starts."""
    while True:
        if opening is not None:
            (channel, recipient), body, opening = opening, pos, None
        else:
            body = text.find(MESSAGE, pos)
            if body < 0:
                return
            channel, recipient = _header(text[pos:body])
            body += len(MESSAGE)
        end = _BODY_END.search(text, body)
        if end is None:
            yield Message(channel, recipient, text[body:], False), len(text)
            return
        pos = end.end()
        if text.startswith(START, pos):
            pos += len(START)
        yield Message(channel, recipient, text[body:end.start()], True), pos


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
        kind = _kind(m.channel, m.recipient)
        if kind == "call":
            if m.done:
                calls.append(ToolCallOut(m.recipient[len(_FUNCTIONS):], m.content.strip()))
        else:
            (reasoning if kind == "reasoning" else content).append(m.content)
    return Parts("\n".join(reasoning), "\n".join(content), calls)


def _kind(channel: str, recipient: str | None) -> str:
    if recipient is not None and recipient.startswith(_FUNCTIONS):
        return "call"
    return "reasoning" if channel == "analysis" else "content"


def enabled(reasoning_parser: str | None, tool_call_parser: str, template: str | None) -> bool:
    """Whether a chat's output is read as harmony: asked for, or the parsers left to pick and the
    chat template writes harmony."""
    if reasoning_parser == "openai_gptoss" or tool_call_parser == "openai":
        return True
    return reasoning_parser is None and tool_call_parser == "auto" and CHANNEL in (template or "")


def held(text: str) -> int:
    """Characters at the end that may be the start of a marker (spelled out, not yet whole)."""
    start = text.rfind("<", max(0, len(text) - _LONGEST + 1))  # a marker has one "<", its first character
    return len(text) - start if start >= 0 and any(m.startswith(text[start:]) for m in _MARKERS) else 0


class HarmonyStream:
    """One choice's output as (reasoning, content, tool calls) deltas: the split of the text so
    far (less an end that may become a marker) minus what was sent; each call whole once its
    message ends. Each chunk reads only what is new: a finished message is read once, and the
    unfinished one's body from where its last search for an end marker stopped."""

    def __init__(self, opening: tuple[str, str | None] | None = None):
        """`opening`: as `messages`'."""
        self.num_calls = 0
        self._pos = 0  # where the first unfinished message starts
        self._header = opening  # its (channel, recipient), once its body began
        self._body = self._searched = 0  # its body's start; no end marker starts before `_searched`
        self._done = {"reasoning": _Joined(), "content": _Joined()}
        self._calls: list[ToolCallOut] = []

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallOut]]:
        """`text`: the whole output so far, special tokens included."""
        limit = len(text) if finished else len(text) - held(text)
        while True:
            if self._header is None:
                body = text.find(MESSAGE, self._pos, limit)
                if body < 0:
                    break
                self._header = _header(text[self._pos:body])
                self._body = self._searched = body + len(MESSAGE)
            end = _BODY_END.search(text, self._searched, limit)
            if end is None:
                self._searched = max(self._body, limit - _LONGEST + 1)
                break
            (channel, recipient), content = self._header, text[self._body:end.start()]
            if (kind := _kind(channel, recipient)) == "call":
                self._calls.append(ToolCallOut(recipient[len(_FUNCTIONS):], content.strip()))
            else:
                self._done[kind].add(content)
            self._pos, self._header = end.end(), None
            if text.startswith(START, self._pos, limit):
                self._pos += len(START)
        growing = None if self._header is None else _kind(*self._header)
        reasoning, content = (joined.delta((text, self._body, limit) if growing == kind else None)
                              for kind, joined in self._done.items())
        calls, self.num_calls = self._calls[self.num_calls:], len(self._calls)
        return reasoning, content, calls


class _Joined:
    """Finished messages' text joined by newlines, and how much of it (with a growing message
    after it) was sent."""

    def __init__(self):
        self.text, self.count, self.sent = "", 0, 0

    def add(self, text: str) -> None:
        self.text = text if not self.count else self.text + "\n" + text
        self.count += 1

    def delta(self, growing: tuple[str, int, int] | None) -> str:
        """What is new, with `growing` (an unfinished message's body: text[start:end]) joined after."""
        if growing is None:
            out, self.sent = self.text[self.sent:], max(self.sent, len(self.text))
            return out
        text, start, end = growing
        head = len(self.text) + (1 if self.count else 0)
        if self.sent >= head:
            out = text[start + self.sent - head:end]
        else:
            out = (self.text + ("\n" if self.count else "") + text[start:end])[self.sent:]
        self.sent = max(self.sent, head + end - start)
        return out
