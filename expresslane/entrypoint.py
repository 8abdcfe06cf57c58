"""`LLM`: the offline, in-process API."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from expresslane.config import EngineConfig
from expresslane.contract import LoRARequest
from expresslane.engine.llm_engine import LLMEngine, Prompt
from expresslane.outputs import RequestOutput
from expresslane.sampling_params import SamplingParams

_TQDM_MIN_PROMPTS = 8  # a progress bar for batches, not for single prompts


class LLM:
    def __init__(self, model: str | None = None, **config: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the generation config's defaults (--generation-config), for ``generate`` without params."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: int | Sequence[int] | None = None, lane: str | Sequence[str] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lane`: interactive or batch (lanes.py); by default picked by priority. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                             len(prompts), "sampling_params")
        prios = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        lanes = lane if isinstance(lane, (list, tuple)) else [lane] * len(prompts)
        lanes = _per_prompt(lanes, len(prompts), "lane")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        ids = []
        try:
            for prompt, sp, prio, ln, lora in zip(prompts, params, prios, lanes, loras):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, sp, prio, lane=ln, lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm and len(ids) >= _TQDM_MIN_PROMPTS)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
