"""Core token outputs -> RequestOutputs with text. An ``n > 1`` request runs as n children
(``{id}#{i}``, seed ``seed + i``); a stop string found here finishes one, the caller aborts it
in the core (``to_abort``)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

from expresslane.contract import EngineCoreOutput, ScoredPrompt
from expresslane.engine.detokenizer import IncrementalDetokenizer, StopStrings
from expresslane.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from expresslane.sampling_params import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """n=1, its own seed; only the first child scores the prompt."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


@dataclass(slots=True)
class _Child:
    parent_id: str  # not the parent: no reference cycle
    output: CompletionOutput
    detok: IncrementalDetokenizer


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[_Child] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # outputs.PromptLogprobs

    def finished(self) -> bool:
        return all(c.output.finished for c in self.children)

    def to_output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output for c in self.children], self.finished(), self.metrics,
                             self.num_cached_tokens, self.prompt_logprobs)


def prompt_logprobs_of(prompt_token_ids: list[int], scored: ScoredPrompt, text) -> list:
    """vLLM's shape: None, then per position the token's and the top-k's Logprob."""
    out: list = [None]
    for j, tok in enumerate(prompt_token_ids[1:1 + len(scored.logprobs)]):
        entry = {tok: Logprob(scored.logprobs[j], scored.ranks[j], text(tok))}
        for rank, (t, v) in enumerate(zip(scored.top_ids[j], scored.top_logprobs[j]), 1):
            if t not in entry:
                entry[t] = Logprob(v, rank, text(t))
        out.append(entry)
    return out


class OutputProcessor:
    def __init__(self, tokenizer, token_texts: Sequence[str] | None = None):
        """`token_texts`: each token id's text, if already decoded."""
        self.tokenizer = tokenizer
        self._token_texts = token_texts
        self._texts: dict[int, str] = {}
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> list[str]:
        """Returns its core (child) request ids."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = _Parent(request_id, prompt, prompt_token_ids, RequestMetrics(arrival_time))
        ids = child_request_ids(request_id, params.n)
        stop = StopStrings(params.stop) if params.stop else None  # shared by the n
        for i, cid in enumerate(ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop,
                                           params.skip_special_tokens, params.include_stop_str_in_output)
            child = _Child(request_id, CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None),
                           detok)
            parent.children.append(child)
            self._children[cid] = child
        self._parents[request_id] = parent
        return ids

    def token_text(self, token_id: int) -> str:
        if self._token_texts is not None:
            return self._token_texts[token_id]
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def parent_of(self, child_id: str) -> str | None:
        child = self._children.get(child_id)
        return None if child is None else child.parent_id

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else child_request_ids(request_id, len(parent.children))

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None or child.output.finished:
                continue  # stopped here while the core still ran it
            parent = self._parents[child.parent_id]
            comp = child.output
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = prompt_logprobs_of(parent.prompt_token_ids, out.prompt_logprobs,
                                                            self.token_text)
            comp.token_ids.extend(out.new_token_ids)
            if out.new_logprobs and comp.logprobs is not None:
                comp.logprobs.extend(out.new_logprobs)
            stop_str = child.detok.add(out.new_token_ids) if out.new_token_ids else None
            comp.text = child.detok.text
            m = parent.metrics
            if out.first_scheduled_time is not None and (m.first_scheduled_time is None
                                                         or out.first_scheduled_time < m.first_scheduled_time):
                m.first_scheduled_time = out.first_scheduled_time
                parent.num_cached_tokens = out.num_cached_tokens
            if out.first_token_time is not None and (m.first_token_time is None
                                                     or out.first_token_time < m.first_token_time):
                m.first_token_time = out.first_token_time
            if stop_str is not None:
                comp.finish_reason, comp.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                m.finished_time = max(m.finished_time or 0.0, out.finished_time or time.monotonic())
            elif out.finish_reason is not None:
                comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                m.finished_time = max(m.finished_time or 0.0, out.finished_time or time.monotonic())
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            results.append(parent.to_output())
            if parent.finished():
                self._forget(parent)
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish as aborted here; the caller aborts its children in the core."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.output.finished:
                child.output.finish_reason = "abort"
        parent.metrics.finished_time = time.monotonic()
        self._forget(parent)
        return parent.to_output()

    def _forget(self, parent: _Parent) -> None:
        del self._parents[parent.request_id]
        for cid in child_request_ids(parent.request_id, len(parent.children)):
            self._children.pop(cid, None)
