"""Structured outputs (xgrammar, imported on first use): docs/architecture.md, "Structured
outputs"."""

from __future__ import annotations

import collections
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from expresslane.config import StructuredOutputConfig
from expresslane.contract import StepPlan
from expresslane.sampling_params import StructuredOutputs

log = logging.getLogger(__name__)

_JSON_OBJECT = '{"type": "object"}'
CLOSERS = ('"', "}", "]", "0")  # JSON's shortest way out, in order of preference


def _choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class Grammars:
    """Compilation, and a matcher per constrained sequence."""

    def __init__(self, load_tokenizer: Callable[[], tuple[object, tuple[int, ...]]], vocab_size: int,
                 config: StructuredOutputConfig):
        """``load_tokenizer() -> (HF tokenizer, EOS ids)``, called once in a worker thread."""
        self._load_tokenizer = load_tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Future | None = None
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._waiting: dict[str, tuple[object, Future, float]] = {}  # id -> (request, compiled, since)
        self.matchers: dict[str, object] = {}
        # id -> (thinking's end tokens, last output tokens, matcher)
        self._thinking: dict[str, tuple[tuple[int, ...], list[int], object]] = {}
        self._json: set[str] = set()  # ids whose output must be JSON

    def _make_compiler(self):
        import xgrammar

        tokenizer, eos = self._load_tokenizer()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(eos))
        texts = {c: [] for c in CLOSERS}
        for i in range(min(len(tokenizer), self.vocab_size)):
            text = tokenizer.decode([i])
            if text in texts:
                texts[text].append(i)
        self._closers = [list(eos)] + [ids for ids in texts.values() if ids]
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def _compile(self, spec: StructuredOutputs):
        compiler = self._compiler.result()
        if spec.json is not None or spec.json_object:
            return compiler.compile_json_schema(spec.json or _JSON_OBJECT, any_whitespace=False)
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(_choice_grammar(spec.choice))
        return compiler.compile_grammar(spec.grammar)

    def compiled(self, spec: StructuredOutputs) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.grammar_compile_threads, thread_name_prefix="grammar")
            self._compiler = self._pool.submit(self._make_compiler)
        key = spec.key
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > self.config.grammar_cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return fut

    def wait(self, req) -> None:
        """Hold ``req`` until its grammar is compiled."""
        self._waiting[req.request_id] = (req, self.compiled(req.sampling_params.structured_outputs), time.monotonic())

    def ready(self, now: float) -> tuple[list, dict[str, str]]:
        """(requests ready, with matchers; {request id: why} refused)."""
        if not self._waiting:
            return [], {}
        import xgrammar

        ready, refused = [], {}
        for rid, (req, fut, since) in list(self._waiting.items()):
            if fut.done():
                del self._waiting[rid]
                if fut.exception() is not None:
                    refused[rid] = f"structured_outputs: the grammar does not compile: {fut.exception()}"
                    continue
                spec = req.sampling_params.structured_outputs
                matcher = xgrammar.GrammarMatcher(fut.result())
                if spec.after_token_ids:
                    self._thinking[rid] = (tuple(spec.after_token_ids), [], matcher)
                else:
                    self.matchers[rid] = matcher
                if spec.json is not None or spec.json_object:
                    self._json.add(rid)
                ready.append(req)
            elif now - since > (timeout := self.config.grammar_compile_timeout_s):
                del self._waiting[rid]
                refused[rid] = f"structured_outputs: the grammar did not compile within {timeout:g} s"
        return ready, refused

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_requests(self) -> list:
        """The requests whose grammar is still compiling."""
        return [req for req, _, _ in self._waiting.values()]

    @property
    def needs_last_tokens(self) -> bool:
        """A step's masks depend on the previous step's tokens (which may end a request's thinking)."""
        return bool(self.matchers or self._thinking)

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)
            self.matchers.pop(rid, None)
            self._thinking.pop(rid, None)
            self._json.discard(rid)

    def fill(self, plan: StepPlan, tokens_left: Callable[[str], tuple[int, int]]) -> None:
        """A row per constrained sampling seq. ``tokens_left(id) -> (left, budget)``."""
        if not self.matchers:
            return
        import torch
        import xgrammar

        seqs = [s for s in plan.seqs if s.sample and s.request_id in self.matchers]
        if not seqs:
            return
        bitmask = xgrammar.allocate_token_bitmask(len(seqs), self.vocab_size)
        for row, s in enumerate(seqs):
            self.matchers[s.request_id].fill_next_token_bitmask(bitmask, row)
            s.bitmask_row = row
        rows = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else np.asarray(bitmask)
        for row, s in enumerate(seqs):
            if s.request_id not in self._json:
                continue
            left, budget = tokens_left(s.request_id)
            if left <= max(self.config.json_close_tokens, budget // self.config.json_close_share):
                self._close(rows[row])
        plan.token_bitmask = rows

    def _close(self, row: np.ndarray) -> None:
        """Keep only the first class of closers the row allows, if any."""
        for ids in self._closers:
            allowed = [t for t in ids if (int(row[t >> 5]) >> (t & 31)) & 1]
            if allowed:
                row[:] = 0
                for t in allowed:
                    row[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
                return

    def landed(self, outputs) -> None:
        """Advance matchers by the landed tokens; drop finished requests'."""
        if not self.needs_last_tokens:
            return
        for out in outputs:
            tokens = out.new_token_ids
            if out.request_id in self._thinking:
                tokens = self._think(out.request_id, tokens)
            matcher = self.matchers.get(out.request_id)
            for t in tokens if matcher is not None else ():
                if not matcher.accept_token(t):  # e.g. forced by min_tokens
                    log.warning("request %s: token %d is outside its grammar", out.request_id, t)
            if out.finish_reason is not None:
                self.forget([out.request_id])

    def _think(self, rid: str, tokens: list[int]) -> list[int]:
        """Once the output ends with the end tokens, start the matcher; returns the tokens after
        them."""
        end, tail, matcher = self._thinking[rid]
        for k, t in enumerate(tokens):
            tail.append(t)
            del tail[:-len(end)]
            if tuple(tail) == end:
                del self._thinking[rid]
                self.matchers[rid] = matcher
                return tokens[k + 1:]
        return []


def tokenizer_loader(tokenizer_dir: Path, model_dir: Path, hf_config) -> Callable[[], tuple[object, tuple[int, ...]]]:
    def load():
        from expresslane.tokenizer import eos_token_ids, load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
        return tokenizer, eos_token_ids(model_dir, hf_config, tokenizer)
    return load
