"""`LLM`: the offline, in-process API."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from expresslane.config import EngineConfig
from expresslane.contract import LoRARequest
from expresslane.engine.llm_engine import LLMEngine, Prompt
from expresslane.outputs import EmbeddingRequestOutput, RequestOutput
from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams

if TYPE_CHECKING:
    from torch import nn

R = TypeVar("R")
_TQDM_MIN_PROMPTS = 8  # a progress bar for batches, not for single prompts


class LLM:
    def __init__(self, model: str | None = None, **config: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self._ids = itertools.count()
        self._shut_down = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the generation config's defaults (--generation-config), for ``generate`` without params."""
        return SamplingParams(**self.engine.sampling_defaults)

    def apply_model(self, func: Callable[[nn.Module], R]) -> list[R]:
        """vLLM's: ``func(model)`` on each rank's model, rank 0 first: one result in one process (the
        object ``func`` returned), one per rank with ``tensor_parallel_size`` > 1. Those ranks get
        ``func`` by cloudpickle (a lambda, a closure or a function they can import) and return its
        result pickled; a rank that fails raises ``RuntimeError`` naming it."""
        self._check_open("apply_model")
        return self.engine.runner.apply_model(func)

    def collective_rpc(self, method: str | Callable[..., R], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[R]:
        """vLLM's: a method of each rank's worker (here its model runner: ``model``, ``device``,
        ``kv_caches``, ...), by name or as ``method(worker, *args, **kwargs)``, rank 0 first, as
        ``apply_model`` sends and returns. ``timeout`` is refused: a call runs to its end."""
        self._check_open("collective_rpc")
        if timeout is not None:
            raise ValueError("collective_rpc: timeout is not supported (a call runs to its end)")
        kwargs = kwargs or {}
        if isinstance(method, str):
            return self.engine.runner.collective_rpc(lambda worker: getattr(worker, method)(*args, **kwargs))
        return self.engine.runner.collective_rpc(lambda worker: method(worker, *args, **kwargs))

    @property
    def cuda_graph_sizes(self) -> dict[str, tuple[int, ...]]:
        """The sizes with a captured CUDA graph, by family: ``decode`` (sequences in a decode
        step) and ``mixed`` (tokens in a step of prefill chunks and decodes). Empty: eager (CPU,
        ``enforce_eager``, or a backend without graphs)."""
        return self.engine.runner.cuda_graph_sizes

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave their process group (idempotent); the engine
        takes no request after it. An engine in one process holds no worker: nothing to stop."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.runner.shutdown()

    def _check_open(self, what: str) -> None:
        if self._shut_down:
            raise RuntimeError(f"{what}: this LLM was shut down")

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: int | Sequence[int] | None = None, lane: str | Sequence[str] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lane`: interactive or batch (lanes.py); by default picked by priority. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        self._check_open("generate")
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

    def embed(self, prompts: Prompt | Sequence[Prompt], *,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              priority: int | Sequence[int] | None = None, lane: str | Sequence[str] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's pooled final hidden state (``runner="pooling"`` or ``task="embed"``).
        ``pooling_params``: ``dimensions`` and ``normalize`` (default: the pooler config's);
        ``truncate_prompt_tokens``: each prompt's last k tokens only (-1: the model's context)."""
        if self.engine.core.pooler is None:
            raise ValueError("embed: this LLM runs a generation model; start it with runner='pooling' "
                             "(or task='embed') for embeddings")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(pooling_params if pooling_params is not None else PoolingParams(), len(prompts),
                             "pooling_params")
        prios = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        lanes = _per_prompt(lane if isinstance(lane, (list, tuple)) else [lane] * len(prompts), len(prompts), "lane")
        ids = []
        try:
            for prompt, pp, prio, ln in zip(prompts, params, prios, lanes):
                rid = str(next(self._ids))
                pp = PoolingParams(pp.dimensions, pp.normalize, truncate_prompt_tokens=pp.truncate_prompt_tokens
                                   if truncate_prompt_tokens is None else truncate_prompt_tokens)
                self.engine.add_pooling_request(rid, prompt, pp, prio, lane=ln)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm and len(ids) >= _TQDM_MIN_PROMPTS, "embed")

    def _run(self, ids: list[str], use_tqdm: bool, what: str = "generate") -> list:
        done: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc=what, unit="req", dynamic_ncols=True)
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
