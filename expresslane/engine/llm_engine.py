"""LLMEngine: an in-process frontend around EngineCore (tokenize, step, detokenize)."""

from __future__ import annotations

import time

from expresslane.config import EngineConfig
from expresslane.engine.contract import EngineCoreRequest
from expresslane.engine.core import EngineCore
from expresslane.engine.output_processor import OutputProcessor, child_params
from expresslane.engine.request import check_prompt_length
from expresslane.lanes import resolve_lane
from expresslane.outputs import RequestOutput
from expresslane.sampling_params import SamplingParams
from expresslane.tokenizer import eos_token_ids, load_tokenizer

Prompt = str | dict


class InputProcessor:
    """Prompt -> token ids, checked against the model (shared by the offline engine and the server)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos = eos

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt).__name__}")

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt_length(len(prompt_token_ids), self.max_model_len)
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size})")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config = self.core.config
        tok_dir = config.model.tokenizer or self.core.model_dir
        self.tokenizer = load_tokenizer(tok_dir)
        eos = eos_token_ids(self.core.model_dir, self.core.hf_config, self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.core.hf_config.vocab_size, self.core.max_model_len, eos)
        self.outputs = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, lane: str | None = None) -> None:
        lane = resolve_lane(lane, priority)
        text, ids = self.inputs.tokenize(prompt)
        self.inputs.check(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = self.outputs.add_request(request_id, text, ids, params, arrival)
        for i, cid in enumerate(child_ids):
            sp = params if params.n == 1 else child_params(params, i)
            self.core.add_request(EngineCoreRequest(cid, ids, sp, self.inputs.eos, arrival, priority, lane))

    def abort(self, request_id: str) -> RequestOutput | None:
        self.core.abort(self.outputs.child_ids(request_id))
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.outputs.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        results, to_abort = self.outputs.process(self.core.step())
        if to_abort:
            self.core.abort(to_abort)
        return results
