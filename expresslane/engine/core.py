"""The step loop (schedule -> execute -> update) on token ids, for LLM and serve alike."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from expresslane.config import EngineConfig
from expresslane.scheduler.batching import make_scheduler
from expresslane.contract import EngineCoreOutput, EngineCoreRequest, LoRARequest, StepPlan, StepStats
from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.cost_model.piecewise import PiecewiseStepCostModel
from expresslane.cost_model.registry import make_cost_model
from expresslane.scheduler.kv_cache import KVCacheManager, max_blocks_per_request
from expresslane.scheduler.partitions import SplitPolicy
from expresslane.scheduler.request import Request, check_prompt_length
from expresslane.scheduler.spec_decode import SpecDecoder
from expresslane.engine.lora import EngineLoRAs
from expresslane.engine.structured_output import Grammars, tokenizer_loader
from expresslane.layers.rotary import length_class, rope_context_limit, rope_restart_length
from expresslane.models.model_dir import check_model_dir, load_hf_config
from expresslane.pooling_params import PoolerConfig, pooler_config, resolve_runner
from expresslane.runner.registry import make_runner
from expresslane.runner.step_result import StepResult
from expresslane.runner.step_timing import calibration_steps, time_steps

log = logging.getLogger(__name__)

@dataclass(slots=True)
class _InFlight:
    plan: StepPlan
    result: StepResult
    shape: StepShape
    index: int
    ends: float = 0.0  # predicted end on the GPU (monotonic; 0: unknown)
    done: float = 0.0  # results known on the host
    speculative: bool = False  # verifies proposals: lands before the next plan
    launched: float = 0.0


def resolve_model_dir(model: str | None) -> Path:
    if model is None:
        from expresslane.models.presets import default_model_dir
        return default_model_dir()
    return check_model_dir(model)


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    """The model's limit (its RoPE's), or `requested` within it (a sliding window does not limit it:
    the attention backends apply it)."""
    limit = rope_context_limit(hf_config)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len {requested} is larger than the model's limit of {limit} tokens")
    return requested


def max_step_tokens(config: EngineConfig) -> int:
    """Most tokens one request computes in a step (static batching: a whole prompt)."""
    if config.scheduler.batching != "continuous":
        return config.model.max_model_len
    return min(config.scheduler.max_num_batched_tokens, config.model.max_model_len)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.model_dir = resolve_model_dir(config.model.model)
        self.hf_config = load_hf_config(self.model_dir)
        config = config.replace(max_model_len=resolve_max_model_len(config.model.max_model_len, self.hf_config))
        m = config.model
        self.runner_type = resolve_runner(m.runner, m.task, getattr(self.hf_config, "architectures", None) or [],
                                          self.model_dir)
        self.pooler: PoolerConfig | None = None
        if self.runner_type == "pooling":
            if config.speculative.method is not None:
                raise ValueError("speculative decoding: not with runner pooling (embeddings sample nothing)")
            self.pooler = pooler_config(self.model_dir, m.override_pooler_config, m.pooler_config)
            config = config.replace(enforce_eager=True)  # pooling steps run eagerly: graphs would be unused memory
            log.info("runner pooling: %s pooling, %s", self.pooler.pooling_type,
                     "normalised" if self.pooler.normalize else "not normalised")
        self.runner = make_runner(config, self.hf_config, self.model_dir)
        try:
            self._start(config)
        except BaseException:
            self.runner.shutdown()  # tensor parallelism's workers
            raise

    def _start(self, config: EngineConfig) -> None:
        bs = config.cache.block_size
        windows = self.runner.kv_groups
        per_request = max_blocks_per_request(config.model.max_model_len, bs, windows, max_step_tokens(config))
        full = max_blocks_per_request(config.model.max_model_len, bs, (None,) * len(windows), 0)
        num_blocks = self.runner.profile_num_blocks(config.scheduler.max_num_seqs * per_request + 1)
        if num_blocks < per_request:
            need = (f"the {per_request} blocks a request holds with sliding windows {windows}" if any(windows)
                    else f"max_model_len={config.model.max_model_len}")
            raise ValueError(f"the KV cache has {num_blocks} blocks of {bs} tokens, fewer than {need}; "
                             "lower max_model_len or give it more memory (num_kv_blocks, gpu_memory_utilization, "
                             "cpu_kv_cache_space_gb)")
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.build_graphs(config.model.max_model_len)
        s = config.scheduler
        cuda = self.runner.device.type == "cuda"

        def calibrate() -> StepCostModel:
            steps = calibration_steps(s.max_num_batched_tokens, s.max_num_seqs, num_blocks, bs,
                                      config.model.max_model_len, light=not cuda)
            return PiecewiseStepCostModel.fit(time_steps(self.runner, steps, repeats=3 if cuda else 1),
                                              s.max_num_batched_tokens, self.runner.padded_step_sizes)

        choice = s.step_cost_model
        if self.runner.interpreted and isinstance(choice, str):
            choice = "nominal"  # no device to time under the interpreter
        self.cost_model = make_cost_model(choice, s.max_num_batched_tokens, calibrate)
        log.info("step cost model (%s): %s", self.runner.device, self.cost_model.describe())
        self.runner.reset_expert_tokens()  # calibration routed dummy tokens
        self._expert_copy = None
        self._steps_since_copy = 0
        self.expert_tokens: dict[int, list[int]] | None = None
        self.config = config.replace(num_kv_blocks=num_blocks, device=str(self.runner.device),
                                     dtype=str(self.runner.dtype).removeprefix("torch."))  # "auto" resolved
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching, windows,
                                 length_class(self.hf_config))
        proposer = self.runner.proposer
        self.spec = None if proposer is None else SpecDecoder(config.speculative, self.cost_model, proposer)
        if self.spec is not None:
            self.spec.draft_cost_ratio = self.runner.draft_cost_ratio()
            self.spec.max_rows = self.runner.verify_rows()
        lora = config.lora
        self.scheduler = make_scheduler(config.scheduler, self.kv, cost_model=self.cost_model, spec=self.spec,
                                        max_loras=lora.max_loras if lora.enable_lora else 0,
                                        rope_restart_at=rope_restart_length(self.hf_config))
        self._lanes: dict[str, _InFlight] = {}
        self._lane_busy = {"decode": 0.0, "prefill": 0.0}
        if s.pd_lanes == "on":
            splits = SplitPolicy(self.cost_model, s.lane_slo["interactive"].tpot)
            self.scheduler.enable_two_lanes(splits)
            if self.runner.bind_partitions(splits.decode_sms()) is None:
                log.warning("pd_lanes on without SM partitions (%s): the lanes take turns on one stream",
                            "no CUDA" if not cuda else "tensor parallel, LoRA or no driver split")
        self.loras = EngineLoRAs(self.runner, lora.enable_lora)
        for adapter in lora.startup_loras():
            self.loras.add(adapter)
        self.grammars = Grammars(tokenizer_loader(Path(config.model.tokenizer or self.model_dir), self.model_dir,
                                                  self.hf_config), self.hf_config.vocab_size,
                                 config.structured_output)
        self._rejected: dict[str, str] = {}
        self._last: StepStats | None = StepStats(0, 0, 0.0)  # None: built when asked
        self._in_flight: _InFlight | None = None
        self._sync_launch = not cuda
        self._calls = 0
        self._host_s = 0.0  # moving average of planning + launching time
        self.held = False  # the last step() launched nothing
        self._last_done: tuple[float, int] | None = None  # (done, index)
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", num_blocks, bs,
                 num_blocks * self.runner.kv_block_bytes() / 2**30, str(self.runner.kv_dtype).removeprefix("torch."))
        if any(windows):
            log.info("sliding windows (KV groups %s): blocks that leave them are freed while their request runs, so a "
                     "request holds at most %d blocks (%.3f GiB), not %d (%.3f GiB) at max_model_len %d", windows,
                     per_request, per_request * self.runner.kv_block_bytes() / 2**30, full,
                     full * self.runner.kv_block_bytes() / 2**30, config.model.max_model_len)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def add_request(self, req: EngineCoreRequest) -> None:
        pooling = req.pooling_params is not None
        if pooling != (self.pooler is not None):
            raise ValueError(f"this engine runs {self.runner_type} (runner); "
                             f"{'an embeddings' if pooling else 'a generation'} request needs runner "
                             f"{'pooling' if pooling else 'generate'}")
        check_prompt_length(len(req.prompt_token_ids), self.max_model_len, pooling)
        if pooling:
            req.pooling_params = req.pooling_params.resolved(self.pooler, self.hf_config.hidden_size)
        sp = req.sampling_params
        if self.spec is not None and (sp.penalized or sp.structured_outputs is not None
                                      or sp.prompt_logprobs is not None or sp.bad_words):
            which = "structured_outputs" if sp.structured_outputs is not None else "prompt_logprobs" \
                if sp.prompt_logprobs is not None else "bad_words" if sp.bad_words \
                else "presence_penalty, frequency_penalty and repetition_penalty"
            raise ValueError(f"{which}: not supported with speculative decoding (--speculative-method)")
        request = Request.from_core_request(req, self.max_model_len)
        self.loras.bind(request, req.lora_request)
        if sp.structured_outputs is None:
            self.scheduler.add_request(request)
        else:
            self.grammars.wait(request)  # to the scheduler once compiled

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self.grammars.forget(request_ids)
        return self.scheduler.abort(request_ids)

    # LoRA adapters (vLLM's add_lora, remove_lora, list_loras)
    def add_lora(self, lora: LoRARequest, wait: bool = True) -> None:
        self.loras.add(lora, wait)

    def take_lora_reads(self) -> dict[int, str | None]:
        """Reads since the last call (`add_lora(wait=False)`)."""
        read, self.loras.read = self.loras.read, {}
        return read

    def _drop_requests_of(self, failed: dict[int, str]) -> None:
        if failed:
            dropped = {r.request_id: failed[r.lora_id] for r in (*self.scheduler.requests.values(),
                                                                 *self.grammars.waiting_requests())
                       if r.lora_id in failed}
            self.abort(list(dropped))
            self._rejected.update(dropped)

    def remove_lora(self, lora_id: int) -> bool:
        """False: no such adapter. Its requests run to their end; it is unloaded after the last."""
        removed = self.loras.remove(lora_id)
        self._collect_loras()
        return removed

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.serving()

    def _collect_loras(self) -> None:
        if self.loras.unloading:
            self.loras.collect([*self.scheduler.requests.values(), *self.grammars.waiting_requests()])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.grammars.num_waiting > 0

    def _tokens_left(self, request_id: str) -> tuple[int, int]:
        req = self.scheduler.requests[request_id]
        return req.max_tokens - req.num_output_tokens, req.max_tokens

    def take_rejected(self) -> dict[str, str]:
        """{request id: why}, since the last call."""
        rejected, self._rejected = self._rejected, {}
        return rejected

    def step(self) -> list[EngineCoreOutput]:
        """Launch step N+1 shortly before step N ends on the GPU (`hold`), then land step N."""
        if self.scheduler.splits is not None and (self._lanes or not self.scheduler.prefill_lane_only()):
            landed, self._in_flight = ([] if self._in_flight is None else self._land(self._in_flight)[0]), None
            return landed + self._step_lanes()
        t0 = time.monotonic()
        prev = self._in_flight
        wait = self.hold(prev, t0)
        self.held = wait > 0
        if self.held:
            time.sleep(min(wait, self.config.scheduler.step_hold_slice_ms / 1e3))
            self._last = None
            return []
        self._calls += 1
        self._take_compiled(t0)
        outputs: list[EngineCoreOutput] = []
        measured = predicted = 0.0
        prev_done: float | None = None
        speculative = prev is not None and (prev.speculative or self.scheduler.speculating())
        # a mask needs the last token: forward, land, fill masks, sample
        late = prev is not None and not speculative and self.grammars.needs_last_tokens
        if speculative or (late and not self.runner.samples_late):
            # a speculative step's outcome (how many tokens) shapes the next plan: no pipelining
            outputs, measured, predicted = self._land(prev)
            self._in_flight = prev = None
            late = False
        planned = time.monotonic()
        if self.loras.enabled:
            self._drop_requests_of(self.loras.stage(self.scheduler))
        plan = self.scheduler.schedule()
        launched = None
        if not plan.is_empty:
            shape = StepShape.of((s.start_pos, len(s.token_ids)) for s in plan.seqs)
            if late:
                forward = self.runner.forward(plan)
                outputs, measured, predicted = self._land(prev)
                prev_done, prev = prev.done, None
                self.grammars.fill(plan, self._tokens_left)
                result = self.runner.sample(forward)
            else:
                self.grammars.fill(plan, self._tokens_left)
                result = self.runner.execute(plan)
            launched = _InFlight(plan, result, shape, self._calls,
                                 speculative=any(s.num_spec_tokens for s in plan.seqs))
            now = time.monotonic()
            self._host_s += 0.1 * (now - planned - self._host_s)
            if self._sync_launch:
                launched.done = now
        if prev is not None:
            outputs, measured, predicted = self._land(prev)
            prev_done = prev.done
        if launched is not None and not self._sync_launch:
            launched.ends = max(time.monotonic() if prev_done is None else prev_done, t0) + self.cost_model.predict(
                launched.shape)
        self._in_flight = launched
        self._collect_loras()
        self._last = self._stats(plan.num_batched_tokens, len(plan.seqs), time.monotonic() - t0, measured, predicted)
        return outputs

    def _step_lanes(self) -> list[EngineCoreOutput]:
        """Land the prefill lane's step once it ended and launch its next; the decode lane's
        pipelined one step deep (unpipelined for grammar masks)."""
        t0 = time.monotonic()
        self._calls += 1
        self._take_compiled(t0)
        lanes, outputs = self._lanes, []
        prefill = lanes.get("prefill")
        if prefill is not None and prefill.result.ready():
            outputs += self._land_lane(lanes.pop("prefill"))
        decode = lanes.pop("decode", None)
        if decode is not None and self.grammars.needs_last_tokens:
            outputs += self._land_lane(decode)
            decode = None
        if self.loras.enabled:
            self._drop_requests_of(self.loras.stage(self.scheduler))
        tokens = seqs = 0
        for lane in ("prefill", "decode"):
            if lane in lanes or (lane == "decode" and not self.scheduler.split.decode_sms):
                continue
            plan = self.scheduler.schedule(lane)
            if plan.is_empty:
                continue
            plan.split_sms = self.scheduler.split.shared_sms
            self.grammars.fill(plan, self._tokens_left)
            shape = StepShape.of((s.start_pos, len(s.token_ids)) for s in plan.seqs)
            launched = time.monotonic()
            lanes[lane] = _InFlight(plan, self.runner.execute(plan), shape, self._calls, launched=launched)
            tokens, seqs = tokens + plan.num_batched_tokens, seqs + len(plan.seqs)
        if decode is not None:
            outputs += self._land_lane(decode)
        self.held = not (seqs or outputs)
        if self.held and lanes:
            time.sleep(self.config.scheduler.step_hold_slice_ms / 1e3)  # a prefill step runs alone
        self._collect_loras()
        self._last = self._stats(tokens, seqs, time.monotonic() - t0)
        return outputs

    def _take_compiled(self, now: float) -> None:
        """Requests whose grammar compiled go to the scheduler; those that failed are rejected."""
        ready, refused = self.grammars.ready(now)
        for request in ready:
            self.scheduler.add_request(request)
        self._rejected.update(refused)

    def _land_lane(self, step: _InFlight) -> list[EngineCoreOutput]:
        outputs = self._land(step)[0]
        self._lane_busy[step.plan.lane] += time.monotonic() - step.launched
        return outputs

    def hold(self, step: _InFlight | None, now: float) -> float:
        """Seconds until `step` is predicted within the hold margin of its end (0: ended)."""
        if step is None or not step.ends or step.speculative or self.scheduler.speculating():
            return 0.0
        s = self.config.scheduler
        wait = step.ends - now - max(s.step_hold_margin_ms / 1e3, s.step_hold_host_factor * self._host_s)
        return wait if wait > 0 and not step.result.ready() else 0.0

    def _stats(self, tokens: int, seqs: int, duration: float, measured: float = 0.0,
               predicted: float = 0.0) -> StepStats:
        stats = StepStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage, num_batched_tokens=tokens, batch_size=seqs,
            step_duration=duration, prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            window_freed_blocks=self.kv.window_freed_blocks, window_saved_blocks=self.kv.window_saved_blocks,
            step_time=measured, predicted_step_time=predicted, expert_tokens=self._expert_load(seqs > 0))
        if self.scheduler.splits is not None:
            split = self.scheduler.split
            stats.decode_lane_sms, stats.prefill_lane_sms = split.decode_sms, split.prefill_sms
            stats.decode_lane_busy_s, stats.prefill_lane_busy_s = self._lane_busy["decode"], self._lane_busy["prefill"]
        if self.loras.enabled:
            running = self.scheduler.running
            stats.lora_running = self.loras.names(r.lora_id for r in running.values())
            stats.lora_waiting = self.loras.names(r.lora_id for r in self.scheduler.requests.values()
                                                  if r.request_id not in running)
            stats.max_loras, stats.lora_loads = self.config.lora.max_loras, self.loras.num_loads
        if self.spec is not None:
            c = self.spec.counters
            stats.spec_num_drafts, stats.spec_num_draft_tokens = c.num_drafts, c.num_draft_tokens
            stats.spec_num_accepted_tokens = c.num_accepted_tokens
        return stats

    def _land(self, step: _InFlight) -> tuple[list[EngineCoreOutput], float, float]:
        """(outputs, the step's time, its prediction)."""
        outputs = self.scheduler.update(step.plan, *step.result.get(), step.result.prompt_logprobs,
                                        step.result.pooled())
        self.grammars.landed(outputs)
        if not self._sync_launch:
            step.done = time.monotonic()
        if self.scheduler.splits is not None:
            return outputs, 0.0, 0.0  # a lane's step time is its split's, not the model's
        return (outputs, *self._time_step(step))

    def _expert_load(self, stepped: bool) -> dict[int, list[int]] | None:
        """Counters if a copy landed; copied every `expert_load_interval` steps, waited for when idle."""
        self._steps_since_copy += stepped
        idle = self._in_flight is None and not self._lanes and not self.scheduler.has_unfinished()
        if self._steps_since_copy and (idle or (self._expert_copy is None
                                                 and self._steps_since_copy >= self.config.parallel.expert_load_interval)):
            self._expert_copy = self.runner.copy_expert_tokens()
            self._steps_since_copy = 0
        copy = self._expert_copy
        if copy is None or not (idle or copy.ready()):
            return None
        self._expert_copy = None
        self.expert_tokens = copy.get()
        return self.expert_tokens

    def _time_step(self, step: _InFlight) -> tuple[float, float]:
        """(time, prediction) of a step right behind the one before, else zeros."""
        last, self._last_done = self._last_done, (step.done, step.index)
        if last is None or last[1] != step.index - 1:
            return 0.0, 0.0
        measured = step.done - last[0]
        predicted = self.cost_model.predict(step.shape)
        if step.speculative:  # another path (not pipelined): it tells speculation what it costs
            self.spec.observe(measured, [(s.start_pos, len(s.token_ids), s.num_spec_tokens) for s in step.plan.seqs])
        else:
            self.cost_model.observe(step.shape, measured)
        return measured, predicted

    def stats(self) -> StepStats:
        if self._last is None:
            self._last = self._stats(0, 0, 0.0)
        return self._last
