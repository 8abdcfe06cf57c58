"""Loads the model, owns the KV-cache memory, executes a StepPlan (no policy)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.kv_groups import layer_groups
from expresslane.attention.registry import get_backend
from expresslane.config import EngineConfig
from expresslane.device import kv_zeros, stage, to_device
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import head_split
from expresslane.contract import LoRARequest, NewRequest, ScheduledSeq, StepPlan
from expresslane.models.loader import iter_weights
from expresslane.models.model_dir import read_config, text_config
from expresslane.models.presets import dummy_weights
from expresslane.models.registry import model_class
from expresslane.quant import resolve_quantization
from expresslane.runner.bad_words import BadWords
from expresslane.runner.base import Forward, LoRAStaging, Runner
from expresslane.runner.cuda_graphs import DecodeGraphs, MixedGraphs, Patch
from expresslane.runner.lora_slots import LoRASlots
from expresslane.runner.expert_load import ExpertTokensCopy, copy_expert_tokens, reset_expert_tokens
from expresslane.runner.request_rows import RequestRows, StepInputs
from expresslane.runner.sm_partitions import SmPartitions, bind
from expresslane.runner.penalties import Penalties
from expresslane.runner.pooling import Pooler
from expresslane.runner.prompt_logprobs import forward_scoring, scored_rows
from expresslane.runner.proposer_registry import make_proposer
from expresslane.runner.sampler import Sampler, SamplingBatch, bitmask_rows
from expresslane.runner.spec_verify import Verified, verify
from expresslane.runner.step_result import StepResult
from expresslane.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return device


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    model_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = _DTYPES.get(model_dtype)
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


class ModelRunner(Runner):
    def __init__(self, config: EngineConfig, hf_config, model_dir: Path, tp: TPGroup | None = None):
        """`tp`: this rank's group; the runner holds its slice of the model."""
        self.config = config
        self.tp = tp or TPGroup.single()
        self.device = resolve_device(config.device.device)
        self.dtype = resolve_dtype(config.model.dtype, hf_config, self.device)
        self.block_size = config.cache.block_size
        self.kv_dtype = torch.float8_e4m3fn if config.cache.kv_cache_dtype.startswith("fp8") else self.dtype
        t0 = time.monotonic()
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        local_heads, _, local_kv_heads, _ = head_split(heads, kv_heads, self.tp)
        family = model_class(hf_config)
        windows = family.attention_windows(hf_config)
        # a model with attention of its own (MLA) never reaches the backend's library prefill
        library = _prefill_library(config, windows) if family.backend_attention else "triton"
        self.attn_backend = get_backend(config.device.attention_backend, local_heads, local_kv_heads, head_dim,
                                        self.device, self.kv_dtype, library,
                                        getattr(hf_config, "attn_logit_softcapping", None),
                                        None if not windows or None in windows else max(windows))
        self.quant = resolve_quantization(hf_config, config.model.quantization)
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = family(hf_config, self.attn_backend, self.quant, self.tp)
            finally:
                torch.set_default_dtype(prev)
        if config.model.load_format == "dummy":
            weights = dummy_weights(text_config(read_config(model_dir)), device=self.device)
        else:
            weights = iter_weights(model_dir, self.device)
        if config.lora.enable_lora and not self.model.supports_lora:
            raise ValueError(f"enable_lora is not supported for {type(self.model).__name__}")
        if self.kv_dtype.itemsize == 1 and not self.model.fp8_kv_cache:
            raise ValueError(f"kv_cache_dtype {config.cache.kv_cache_dtype!r} is not supported for "
                             f"{type(self.model).__name__}; use kv_cache_dtype 'auto'")
        self.model.load_weights(weights)
        self.model.eval()
        if config.device.fused_decode_layer:
            self._fuse_decode_layers()
        self.lora = LoRASlots(self.model, config.lora, self.device, self.dtype, self.attn_backend.fused_ops,
                              wait_reads=self.device.type != "cuda" or self.tp.size > 1) \
            if config.lora.enable_lora else None
        self.proposer = make_proposer(config.speculative, hf_config.vocab_size, self.device, self.dtype,
                                      config.device.attention_backend)
        self.layer_group, self.layer_slab, self.kv_groups = self._kv_groups(windows)
        for layer, group in zip(self.model.layers, self.layer_group):
            layer.self_attn.kv_group = group
        log.info("loaded %s in %.1fs on %s (%s%s)", model_dir, time.monotonic() - t0, self.device, self.dtype,
                 f", {self.quant.name} weights" if self.quant else "")
        cached, full = math.prod(self.model.kv_cache_shape(1, 1)), self.model.full_kv_values()
        if cached != full:
            log.info("KV cache: %d bytes per token (%d values a layer, latent); full K and V would take %d bytes",
                     cached * len(self.model.layers) * self.kv_dtype.itemsize, cached,
                     full * len(self.model.layers) * self.kv_dtype.itemsize)
        self.sampler = Sampler(self.device, config.model.seed)
        self.penalties = Penalties(config.scheduler.max_num_seqs, hf_config.vocab_size, self.device)
        self.bad_words = BadWords(config.scheduler.max_num_seqs, self.device)
        self._generators: dict[str, torch.Generator] = {}
        self.pooler = Pooler()
        s = config.scheduler
        longest = max(config.model.max_model_len or 0, s.max_num_batched_tokens)  # (the profiling step's)
        self.rows = RequestRows(s.max_num_seqs, -(-longest // self.block_size), self.block_size, len(self.kv_groups))
        self.kv_caches: list[torch.Tensor] = []
        self._prev: dict[str | None, tuple[torch.Tensor | None, dict[str, int]]] = {}  # lane -> last step's ids
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.partitions: SmPartitions | None = None
        self._graph_pool = None

    def _fuse_decode_layers(self) -> None:
        """Fold the norms into the weights where valid, else log why not."""
        why = self.model.fused_decode_refusal()
        if not self.attn_backend.fused_ops:
            why = "the triton attention backend only"
        elif not (self.attn_backend.interpreted or self.device.type == "cuda" and
                  self.dtype in (torch.float16, torch.bfloat16)):
            why = f"CUDA with bfloat16/float16 only, not {self.device.type} with {self.dtype}"
        if why:
            log.warning("fused_decode_layer is off: %s", why)
            return
        self.model.enable_fused_decode()
        log.info("fused decode layer: the norms folded into %d layers' QKV and gate|up weights", len(self.model.layers))

    def _kv_groups(self, windows: list[int | None]) -> tuple[list[int], list[int], tuple[int | None, ...]]:
        """A window of max_model_len reads every key; with a draft model's cache (sharing the
        block ids) every layer does."""
        longest = self.config.model.max_model_len
        windows = [None if w is None or longest and w >= longest else w for w in windows]
        if any(windows) and self.proposer is not None and self.proposer.kv_block_bytes(self.block_size,
                                                                                        self.kv_dtype):
            log.info("sliding window: the draft model's cache shares the block ids, so no KV block is freed "
                     "while a request runs")
            windows = [None] * len(windows)
        return layer_groups(windows)

    def kv_block_bytes(self) -> int:
        per_layer = math.prod(self.model.kv_cache_shape(1, self.block_size)) * self.kv_dtype.itemsize
        proposer = self.proposer.kv_block_bytes(self.block_size, self.kv_dtype) if self.proposer else 0
        return per_layer * (max(self.layer_slab) + 1) + proposer

    @torch.inference_mode()
    def profile_num_blocks(self, max_blocks: int) -> int:
        """In the CPU budget, or the GPU memory left after a worst-case step."""
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        if self.device.type == "cpu":
            budget = int(self.config.cache.cpu_kv_cache_space_gb * (1 << 30))
            return min(max_blocks, budget // self.kv_block_bytes())
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.scheduler.max_num_batched_tokens
        num_seqs = min(self.config.scheduler.max_num_seqs, n)
        self._dummy_step(n, num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        available = total * self.config.cache.gpu_memory_utilization - peak
        if available <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache: peak use {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB; raise gpu_memory_utilization")
        return min(max_blocks, int(available // self.kv_block_bytes()))

    def _dummy_step(self, num_tokens: int, num_seqs: int) -> None:
        """A forward of `num_tokens` over `num_seqs` prompts."""
        per_seq = num_tokens // num_seqs
        nblocks = -(-per_seq // self.block_size)
        self.allocate_kv_cache(num_seqs * nblocks + 1)
        ids = [f"profile-{i}" for i in range(num_seqs)]
        seqs = [ScheduledSeq(rid, [0] * per_seq, 0, list(range(i * nblocks, (i + 1) * nblocks)) * len(self.kv_groups),
                             True)
                for i, rid in enumerate(ids)]
        self.execute(StepPlan(-1, seqs, per_seq * num_seqs, [NewRequest(rid, _GREEDY) for rid in ids])).get()
        self.release(ids)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [kv_zeros(shape, self.kv_dtype, self.device) for _ in range(max(self.layer_slab) + 1)]
        for layer, slab in zip(self.model.layers, self.layer_slab):
            layer.self_attn.kv_cache = self.kv_caches[slab]
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks, self.block_size, self.kv_dtype)

    def build_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """The library prefill's plans, then the graphs where allowed."""
        t0 = time.monotonic()
        if n := self.attn_backend.warm_library(self.dtype, self.device, max_model_len,
                                               self.config.scheduler.max_num_batched_tokens):
            log.info("built %d cuDNN attention plans in %.1fs", n, time.monotonic() - t0)
        if self.config.device.enforce_eager or not self.attn_backend.supports_cuda_graphs:
            return
        if self.lora is not None and not self.lora.state.use_triton:
            log.warning("CUDA graphs are off with enable_lora on the torch attention backend")
            return
        if capture and self.device.type != "cuda":
            return
        max_blocks = -(-max_model_len // self.block_size)
        s = self.config.scheduler
        mixed_tokens = min(self.config.device.max_mixed_graph_tokens, s.max_num_batched_tokens)
        vocab = self.model.config.vocab_size
        logits_out = torch.empty(s.max_num_seqs, vocab, dtype=torch.float32, device=self.device)
        self.decode_graphs = DecodeGraphs(self.model, self.attn_backend, s.max_num_seqs, max_blocks, self.device,
                                          logits_out, len(self.kv_groups))
        self.mixed_graphs = MixedGraphs(self.model, self.attn_backend, mixed_tokens, s.max_num_seqs, max_blocks,
                                        self.device, logits_out, len(self.kv_groups))
        pool = self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        if capture:
            self.decode_graphs.capture(pool)
            self.mixed_graphs.capture(pool)
        if self.proposer is not None:
            self.proposer.build_graphs(s.max_num_seqs, mixed_tokens, max_blocks, pool, self.block_size)

    @property
    def padded_step_sizes(self) -> tuple[int, ...]:
        return () if self.mixed_graphs is None else tuple(self.mixed_graphs.sizes)

    @property
    def interpreted(self) -> bool:
        return self.attn_backend.interpreted

    @property
    def samples_late(self) -> bool:
        return True

    def apply_model(self, func):
        return [func(self.model)]

    def collective_rpc(self, func):
        return [func(self)]

    @property
    def cuda_graph_sizes(self) -> dict[str, tuple[int, ...]]:
        return {name: () if graphs is None else tuple(sorted(graphs.graphs))
                for name, graphs in (("decode", self.decode_graphs), ("mixed", self.mixed_graphs))}

    def copy_expert_tokens(self) -> ExpertTokensCopy | None:
        return copy_expert_tokens(self.model)

    def reset_expert_tokens(self) -> None:
        reset_expert_tokens(self.model)

    def bind_partitions(self, decode_sms: list[int]) -> SmPartitions | None:
        if self.device.type == "cuda" and self.tp.size == 1 and self.lora is None:
            torch.cuda.synchronize(self.device)  # start-up's work, on another stream
            self.partitions = bind(self.device, decode_sms)
        graphs = [g for g in (self.decode_graphs, self.mixed_graphs) if g is not None and g.graphs]
        for sms in decode_sms if self.partitions is not None else ():
            for g in graphs:
                g.capture(self._graph_pool, self.partitions.stream("decode", sms), sms)
        return self.partitions

    def _on_lane(self, plan: StepPlan):
        if self.partitions is None:
            return contextlib.nullcontext()
        for g in (self.decode_graphs, self.mixed_graphs):
            if g is not None:
                g.placement = plan.split_sms if plan.lane == "decode" and plan.split_sms in g.placed else 0
        if plan.lane is None:
            return contextlib.nullcontext()
        return self.partitions.running(plan.lane, plan.split_sms, [self._prev.get(plan.lane, (None,))[0]])

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        with self._on_lane(plan):
            inputs = self._apply(plan)
            if inputs.num_spec.any():
                return self._execute_spec(inputs)
            return self._sample(inputs, *self._logits(inputs, plan.lane), plan)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> Forward:
        inputs = self._apply(plan)
        return Forward(plan, inputs, *self._logits(inputs, plan.lane))

    @torch.inference_mode()
    def sample(self, step: Forward) -> StepResult:
        return self._sample(step.inputs, step.logits, step.prompt_logprobs, step.pooled, step.plan)

    def _apply(self, plan: StepPlan) -> StepInputs:
        for rid in plan.finished_request_ids:
            self._generators.pop(rid, None)
        self.pooler.forget(plan.finished_request_ids)
        self.pooler.forget(plan.preempted_request_ids)
        for rid in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.penalties.remove(self.rows.row_of.get(rid))
            self.bad_words.remove(self.rows.row_of.get(rid))
        inputs = self.rows.apply(plan)
        if self.lora is not None:
            self.lora.prepare(self.rows.token_lora_ids(inputs))
        if self.partitions is not None and any(n.sampling_params.penalized or n.sampling_params.bad_words_token_ids
                                               for n in plan.new_requests):
            self.partitions.barrier(plan.lane)  # may replace the state tensors
        for new in plan.new_requests:
            self.penalties.add(self.rows.row_of[new.request_id], new)
            self.bad_words.add(self.rows.row_of[new.request_id], new)
        return inputs

    def _sample(self, inputs: StepInputs, logits: torch.Tensor | None, prompt: dict | None,
                pooled, plan: StepPlan) -> StepResult:
        if logits is None:
            self._prev[plan.lane] = (None, {})  # nothing sampled: no next-step input from here
            return StepResult(self.device, [], None, None, prompt_logprobs=prompt, pooled=pooled)
        ids = [inputs.seqs[i].request_id for i in inputs.sampling]
        params, banned = self.rows.sampling_rows(inputs)
        bitmask = None if plan.token_bitmask is None else bitmask_rows(
            plan.token_bitmask, [inputs.seqs[i].bitmask_row for i in inputs.sampling])
        penalized, words = bool(self.penalties.params), bool(self.bad_words.words)
        rows = [int(inputs.rows[i]) for i in inputs.sampling] if penalized or words else None
        batch = SamplingBatch(params, banned, [self._generator(rid, p) for rid, p in zip(ids, params)], bitmask,
                              penalize=(lambda lg: self.penalties.apply(lg, rows)) if penalized else None,
                              ban_words=(lambda lg: self.bad_words.apply(lg, rows)) if words else None)
        tokens, logprobs = self.sampler(logits, batch)
        if penalized:
            self.penalties.sampled(rows, tokens)
        if words:
            self.bad_words.sampled(rows, tokens)
        self._prev[plan.lane] = (tokens, {rid: i for i, rid in enumerate(ids)})
        return StepResult(self.device, ids, tokens, logprobs, prompt_logprobs=prompt, pooled=pooled)

    def add_lora(self, lora: LoRARequest, wait: bool = True) -> None:
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the engine was started without enable_lora")
        self.lora.add(lora, wait)

    def remove_lora(self, lora_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_id)

    @torch.inference_mode()
    def stage_loras(self, wanted: list[int], keep: set[int]) -> LoRAStaging:
        return LoRAStaging(set()) if self.lora is None else self.lora.stage(wanted, keep)

    def shutdown(self) -> None:
        if self.lora is not None:
            self.lora.close()

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
        self.pooler.forget(request_ids)
        self.rows.apply(StepPlan(-1, [], 0, finished_request_ids=request_ids))

    def _execute_spec(self, inputs: StepInputs) -> StepResult:
        """The core lands a verify step before the next plan: no later step takes an input token
        from it on the device."""
        sampling = inputs.sampling
        ends = inputs.query_start_loc[1:][sampling].astype(np.int64)  # one past each sampling seq's end
        counts = inputs.num_spec[sampling]
        spec, plain = np.flatnonzero(counts > 0), np.flatnonzero(counts == 0)
        ids = [inputs.seqs[i].request_id for i in sampling]
        params, banned = self.rows.sampling_rows(inputs)
        gens = [self._generator(rid, p) for rid, p in zip(ids, params)]
        spec_params = [params[i] for i in spec]  # (seeded sampling does not speculate)
        k = counts[spec]
        # proposals: the verify step's inputs
        drafts, draft_probs, patch = self.proposer.step_proposals(self, inputs, sampling[spec], ends[spec], k,
                                                                  spec_params, self.sampler.generator)
        # logits rows: plain seqs' last token, then each speculating seq's last known token and
        # proposals, padded to `width` by repeating its last row
        width = int(k.max()) + 1
        spec_rows = (ends[spec] - k - 1)[:, None] + np.minimum(np.arange(width)[None, :], k[:, None])
        rows = np.concatenate([ends[plain] - 1, spec_rows.reshape(-1)])
        logits = self._logits_at(inputs, patch, rows.astype(np.int64))
        self._prev[None] = (None, {})
        plain_tokens = logprobs = None
        if len(plain):
            batch = SamplingBatch([params[i] for i in plain], [banned[i] for i in plain], [gens[i] for i in plain])
            plain_tokens, logprobs = self.sampler(logits[:len(plain)], batch)
        verified = verify(logits[len(plain):].view(len(spec), width, -1), k, drafts, spec_params,
                          self.sampler.generator, draft_probs)
        return StepResult(self.device, [ids[i] for i in plain], plain_tokens, logprobs, ([ids[i] for i in spec], verified))

    def _logits_at(self, inputs: StepInputs, patch: Patch | None, rows: np.ndarray) -> torch.Tensor:
        """Logits at token indices `rows`, by mixed-step graph if it fits, else eager."""
        graphs = self.mixed_graphs
        if (graphs is not None and graphs.fits_rows(inputs.num_tokens, len(inputs.seqs), len(rows))
                and not self.attn_backend.eager_step(inputs.query_start_loc, inputs.seq_lens, inputs.num_decodes)):
            return graphs.run(inputs, patch, rows)
        input_ids, positions, meta = self._prepare(inputs, patch)
        hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden[to_device(rows, torch.int64, self.device)])

    def verify_rows(self) -> int | None:
        """(`MixedGraphs.fits_rows`)"""
        return self.mixed_graphs.max_seqs if self.mixed_graphs is not None else None

    def draft_cost_ratio(self) -> float:
        if self.proposer is None:
            return 0.0
        return self.proposer.cost_ratio(sum(p.numel() for p in self.model.parameters()))

    def _logits(self, inputs: StepInputs, lane: str | None = None):
        """(sampling seqs' logits, prompt logprobs, pooled vectors), each None if no seq asks."""
        patch = self._previous_tokens_patch(inputs, lane)
        scored = scored_rows(inputs)
        if scored is None and not len(inputs.pooling):
            eager = self.partitions is not None and lane == "prefill"  # the graphs' inputs: the decode lane's
            graphs = (None, None) if eager else (self.decode_graphs, self.mixed_graphs)
            return self.forward_logits(self.model, self.attn_backend, *graphs, inputs, patch, inputs.sampling), None, None
        if not len(inputs.pooling):
            top_k = [self.rows.params[r].prompt_logprobs or 0 for r in inputs.rows]
            return *forward_scoring(self.model, *self._prepare(inputs, patch), inputs, scored, top_k), None
        hidden = self.model(*self._prepare(inputs, patch))
        last = (inputs.query_start_loc[1:] - 1)[inputs.sampling]
        logits = self.model.compute_logits(hidden[to_device(last, torch.int64, self.device)]) if len(last) else None
        return logits, None, self.pooler.pool(hidden, inputs, self.rows.pooling)

    def forward_logits(self, model, backend, decode_graphs, mixed_graphs, inputs: StepInputs, patch: Patch | None,
                       seqs: np.ndarray | None = None) -> torch.Tensor | None:
        """Target or draft, by graph if one fits, else eager: logits at the last token of `seqs`
        (ascending; None: all; empty: None)."""
        num_tokens, num_seqs = inputs.num_tokens, len(inputs.seqs)
        if decode_graphs is not None and decode_graphs.fits(num_tokens, num_seqs):
            logits = decode_graphs.run(inputs, patch)
        elif (mixed_graphs is not None and mixed_graphs.fits(num_tokens, num_seqs)
              and not backend.eager_step(inputs.query_start_loc, inputs.seq_lens, inputs.num_decodes)):
            logits = mixed_graphs.run(inputs, patch)
        else:  # eager: those rows only
            input_ids, positions, meta = self._prepare(inputs, patch, backend)
            hidden = model(input_ids, positions, meta)
            if seqs is not None and not len(seqs):
                return None
            last = inputs.query_start_loc[1:] - 1
            return model.compute_logits(hidden[to_device(last if seqs is None else last[seqs], torch.int64,
                                                         self.device)])
        if seqs is not None and not len(seqs):
            return None
        if seqs is None or len(seqs) == num_seqs:  # every seq, in order
            return logits
        return logits[to_device(seqs, torch.int64, self.device)]

    def _previous_tokens_patch(self, inputs: StepInputs, lane: str | None = None) -> Patch | None:
        """The lane's previous step's sampled ids, on the device."""
        if not len(inputs.from_previous):
            return None
        tokens, rows = self._prev[lane]
        src = np.array([rows[inputs.seqs[i].request_id] for i in inputs.from_previous], dtype=np.int64)
        return Patch(inputs.query_start_loc[inputs.from_previous].astype(np.int64), src, tokens)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        return gen

    def _prepare(self, inputs: StepInputs, patch: Patch | None = None, backend=None):
        """Eager inputs and attention metadata, in one host->device copy."""
        arrays = [inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables, inputs.seq_lens,
                  inputs.query_start_loc, inputs.rope_lengths]
        staged = stage(arrays + (list(patch.indices) if patch else []), self.device)
        input_ids, positions, slots, tables, seq_lens, qsl, rope_lengths = staged[:7]
        tables, slots = tables.view(inputs.block_tables.shape).to(torch.int32), slots.view(inputs.slot_mapping.shape)
        if patch is not None:
            patch.apply(input_ids, *staged[7:])
        nd = inputs.num_decodes
        meta = AttentionMetadata(
            slot_mapping=slots[0], block_tables=tables[0], seq_lens=seq_lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32), num_decodes=nd, seq_lens_cpu=inputs.seq_lens.tolist(),
            query_start_loc_cpu=inputs.query_start_loc.tolist(),
            max_decode_seq_len=int(inputs.seq_lens[:nd].max()) if nd else 0, rope_lengths=rope_lengths)
        (backend or self.attn_backend).prepare(meta)
        return input_ids, positions, meta.with_groups(slots, tables)


def _prefill_library(config: EngineConfig, windows: list[int | None]) -> str:
    """prefill_attention; the library has no window."""
    choice = config.device.prefill_attention
    if choice == "triton" or all(w is None for w in windows):
        return choice
    if choice == "cudnn":
        raise ValueError("prefill_attention 'cudnn' cannot run this model's sliding-window attention; use 'auto' "
                         "or 'triton'")
    return "triton"


_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
