"""An in-process frontend around EngineCore (tokenize, step, detokenize)."""

from __future__ import annotations

import time

from expresslane.config import EngineConfig
from expresslane.contract import EngineCoreRequest, LoRARequest
from expresslane.engine.core import EngineCore
from expresslane.engine.generation_config import sampling_defaults
from expresslane.engine.inputs import InputProcessor, Prompt
from expresslane.engine.output_processor import OutputProcessor, child_params
from expresslane.lanes import resolve_lane
from expresslane.outputs import RequestOutput
from expresslane.sampling_params import SamplingParams
from expresslane.tokenizer import eos_token_ids, load_tokenizer

class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config = self.core.config
        tok_dir = config.model.tokenizer or self.core.model_dir
        self.tokenizer = load_tokenizer(tok_dir)
        eos = eos_token_ids(self.core.model_dir, self.core.hf_config, self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.core.hf_config.vocab_size, self.core.max_model_len, eos)
        self.outputs = OutputProcessor(self.tokenizer)
        self.sampling_defaults = sampling_defaults(config.model.generation_config, self.core.model_dir)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, lane: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        lane = resolve_lane(lane, priority)
        text, ids = self.inputs.tokenize(prompt)
        self.inputs.check(ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = self.outputs.add_request(request_id, text, ids, params, arrival)
        try:
            for i, cid in enumerate(child_ids):
                sp = params if params.n == 1 else child_params(params, i)
                self.core.add_request(EngineCoreRequest(cid, ids, sp, self.inputs.eos, arrival, priority, lane,
                                                        lora_request=lora_request))
        except Exception:  # refused by the core (its adapter, say): no trace of it stays
            self.abort(request_id)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return {lora.lora_int_id for lora in self.core.list_loras()}

    def abort(self, request_id: str) -> RequestOutput | None:
        self.core.abort(self.outputs.child_ids(request_id))
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.outputs.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        results, to_abort = self.outputs.process(self.core.step())
        if to_abort:
            self.core.abort(to_abort)
        rejected = self.core.take_rejected()
        if rejected:  # after add_request returned (a grammar that does not compile): its request is dropped
            request_id, why = next(iter(rejected.items()))
            for rid in {self.outputs.parent_of(cid) for cid in rejected} - {None}:
                self.abort(rid)
            raise ValueError(f"request {request_id}: {why}")
        return results
