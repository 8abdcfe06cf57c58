"""An in-process frontend around EngineCore (tokenize, step, detokenize)."""

from __future__ import annotations

import time

from expresslane.config import EngineConfig
from expresslane.contract import POOLING_SAMPLING, EngineCoreRequest, LoRARequest
from expresslane.engine.core import EngineCore
from expresslane.engine.generation_config import sampling_defaults
from expresslane.engine.inputs import InputProcessor, Prompt
from expresslane.engine.output_processor import OutputProcessor, child_params
from expresslane.lanes import resolve_lane
from expresslane.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestMetrics, RequestOutput
from expresslane.pooling_params import PoolingParams
from expresslane.runner.base import Runner
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
        self._pooling: dict[str, EmbeddingRequestOutput] = {}  # unfinished pooling requests

    @property
    def runner(self) -> Runner:
        """The one place tests and benchmarks of the runner itself take it from; everything else
        goes through ``LLM``'s methods."""
        return self.core.runner

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, lane: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        if self.core.pooler is not None:
            raise ValueError("this engine runs pooling (runner): generation needs runner generate; LLM.embed "
                             "serves embeddings")
        lane = resolve_lane(lane, priority)
        text, ids = self.inputs.truncate(*self.inputs.tokenize(prompt), params.truncate_prompt_tokens)
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

    def add_pooling_request(self, request_id: str, prompt: Prompt, params: PoolingParams, priority: int = 0,
                            arrival_time: float | None = None, lane: str | None = None) -> None:
        """An embeddings request (runner pooling): finishes with its pooled vector."""
        if request_id in self._pooling or self.outputs.child_ids(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        lane = resolve_lane(lane, priority)
        text, ids = self.inputs.truncate(*self.inputs.tokenize(prompt), params.truncate_prompt_tokens)
        self.inputs.check_pooling(ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(EngineCoreRequest(request_id, ids, POOLING_SAMPLING, (), arrival, priority, lane,
                                                pooling_params=params))
        self._pooling[request_id] = EmbeddingRequestOutput(request_id, EmbeddingOutput([]), ids, False,
                                                           RequestMetrics(arrival), text)

    def abort(self, request_id: str) -> RequestOutput | None:
        if self._pooling.pop(request_id, None) is not None:
            self.core.abort([request_id])
            return None
        self.core.abort(self.outputs.child_ids(request_id))
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.outputs.num_unfinished > 0 or bool(self._pooling)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        core_outputs = self.core.step()
        pooled = [self._pooled(o) for o in core_outputs if o.request_id in self._pooling]
        results, to_abort = self.outputs.process([o for o in core_outputs if o.request_id not in self._pooling])
        if to_abort:
            self.core.abort(to_abort)
        rejected = self.core.take_rejected()
        if rejected:  # after add_request returned (a grammar that does not compile): its request is dropped
            request_id, why = next(iter(rejected.items()))
            for rid in {self.outputs.parent_of(cid) for cid in rejected} - {None}:
                self.abort(rid)
            raise ValueError(f"request {request_id}: {why}")
        return results + [p for p in pooled if p is not None]

    def _pooled(self, out) -> EmbeddingRequestOutput | None:
        """Its output once finished (an abort drops it)."""
        if out.finish_reason is None:
            return None
        result = self._pooling.pop(out.request_id)
        if out.pooled is None:
            return None
        result.outputs.embedding, result.finished, result.num_cached_tokens = out.pooled, True, out.num_cached_tokens
        m = result.metrics
        m.first_scheduled_time, m.first_token_time, m.finished_time = (out.first_scheduled_time, out.first_token_time,
                                                                       out.finished_time)
        return result
