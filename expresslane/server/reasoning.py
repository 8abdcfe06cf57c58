"""Reasoning models' thinking, split from their answer (``--reasoning-parser``): the message's
``reasoning_content`` and ``content``, and the same split in stream deltas.

- ``qwen3``: the model opens ``<think>`` itself; without it (``enable_thinking: false``) all is
  content.
- ``deepseek_r1``: the chat template opens the thinking in the prompt, so the output is
  reasoning up to ``</think>``, whether or not it repeats ``<think>`` first; with no ``</think>``
  (yet), all of it is reasoning.

A grammar (structured outputs, a forced tool call) holds the answer only: it starts once the
output has written ``</think>`` (``StructuredOutputs.after_token_ids``), unless the prompt has
closed the thinking already (Qwen3's ``enable_thinking: false``). gpt-oss's harmony
(``openai_gptoss``): once it has opened its answer's message, ``<|channel|>final<|message|>``.
"""

from __future__ import annotations

import dataclasses

from expresslane.models.harmony import CHANNEL, MESSAGE, START
from expresslane.sampling_params import SamplingParams

OPEN, CLOSE = "<think>", "</think>"
HARMONY_ANSWER = CHANNEL + "final" + MESSAGE
PARSERS = ("qwen3", "deepseek_r1")


def split(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a completion's text."""
    stripped = text.lstrip()
    if parser == "qwen3" and not stripped.startswith(OPEN):
        return None, text
    body = stripped[len(OPEN):] if stripped.startswith(OPEN) else text
    end = body.find(CLOSE)
    if end < 0:
        return body.strip() or None, ""
    return body[:end].strip() or None, body[end + len(CLOSE):].lstrip()


class ReasoningStream:
    """One choice's text as (reasoning, content) deltas: the split of the text so far, less the
    end that might still become a tag, minus what was sent."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self._reasoning_sent = 0
        self._content_sent = 0

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        self.text += piece
        visible = self.text if finished else self.text[:len(self.text) - self._held(self.text)]
        reasoning, content = split(self.parser, visible)
        reasoning = reasoning or ""
        out = reasoning[self._reasoning_sent:], content[self._content_sent:]
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        self._content_sent = max(self._content_sent, len(content))
        return out

    @staticmethod
    def _held(text: str) -> int:
        """Characters at the end that may be the start of a tag."""
        for tag in (CLOSE, OPEN):
            for k in range(min(len(tag) - 1, len(text)), 0, -1):
                if tag.startswith(text[-k:]):
                    return k
        return 0


def thinking_ended(prompt: str, parser: str | None = None) -> bool:
    """The prompt closed the thinking: its last tag is ``</think>`` (vLLM's check on the prompt);
    harmony's leaves its answer's message open (a continued final message)."""
    if parser == "openai_gptoss":
        return prompt.rfind(HARMONY_ANSWER) > prompt.rfind(START)
    return prompt.rfind(CLOSE) > prompt.rfind(OPEN) if CLOSE in prompt else False


def grammar_after_thinking(params: SamplingParams, prompt: str, tokenizer, parser: str | None = None
                           ) -> SamplingParams:
    """``params`` whose grammar waits for the end of the thinking, unless the prompt ended it."""
    so = params.structured_outputs
    if so is None or thinking_ended(prompt, parser):
        return params
    end = tokenizer.encode(HARMONY_ANSWER if parser == "openai_gptoss" else CLOSE, add_special_tokens=False)
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, after_token_ids=end))
