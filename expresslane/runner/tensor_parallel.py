"""Tensor parallelism, rank 0's side: model-touching calls broadcast over gloo, run by every
rank."""

from __future__ import annotations

import atexit
import logging
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import cloudpickle
import torch
import torch.distributed as dist

from expresslane.config import EngineConfig
from expresslane.contract import LoRARequest
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import even_split, head_split
from expresslane.layers.moe import check_expert_split, num_experts_of
from expresslane.runner.base import LoRAStaging, Runner
from expresslane.runner.model_runner import ModelRunner, resolve_device

log = logging.getLogger(__name__)

INIT_TIMEOUT = timedelta(minutes=10)  # ranks on other nodes may start later than rank 0


def check_splits(config: EngineConfig, hf_config) -> None:
    """Refuse a model the ranks cannot split."""
    p = config.parallel
    size = p.tensor_parallel_size
    heads = hf_config.num_attention_heads
    head_split(heads, getattr(hf_config, "num_key_value_heads", None) or heads, TPGroup(0, size))
    even_split(hf_config.intermediate_size, TPGroup(0, size), "intermediate size")
    if hasattr(hf_config, "num_experts_per_tok"):  # a mixture of experts
        if p.enable_expert_parallel:
            check_expert_split(num_experts_of(hf_config), size)
        else:
            even_split(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size,
                       TPGroup(0, size), "MoE intermediate size")
    qc = getattr(hf_config, "quantization_config", None) or {}
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if config.model.quantization or (qc and method != "mxfp4"):  # gpt-oss's MXFP4 experts: split by expert
        raise ValueError("tensor parallelism with quantized weights is not supported yet; use "
                         "tensor_parallel_size=1 or an unquantized checkpoint")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type(config: EngineConfig) -> str:
    return resolve_device(config.device.device).type


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    """This rank's config (cuda:local_rank on GPU)."""
    if device_type(config) != "cuda":
        return config
    torch.cuda.set_device(local_rank)
    return config.replace(device=f"cuda:{local_rank}")


def init_group(rank: int, world_size: int, addr: str, dev_type: str) -> object:
    """Returns the gloo control group."""
    backend = "nccl" if dev_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}", rank=rank, world_size=world_size,
                            timeout=INIT_TIMEOUT)
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def spawn_workers(ranks: list[tuple[int, int]], per_node: int, world_size: int, addr: str,
                  dev_type: str) -> list[subprocess.Popen]:
    """One worker process per (global rank, local rank)."""
    return [subprocess.Popen([sys.executable, "-m", "expresslane.runner.tp_worker", "--rank", str(rank),
                              "--local-rank", str(local), "--local-world-size", str(per_node), "--world-size",
                              str(world_size), "--init-addr", addr, "--device-type", dev_type])
            for rank, local in ranks]


def run_command(runner: ModelRunner, control, method: str, args: tuple):
    """One command, run by every rank."""
    if method == "profile_num_blocks":  # the smallest count
        n = torch.tensor([runner.profile_num_blocks(*args)], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=control)
        return int(n)
    if method in ("apply_model", "collective_rpc"):
        return apply_on_rank(runner.model if method == "apply_model" else runner, control, *args)
    return getattr(runner, method)(*args)


def apply_on_rank(target, control, payload: bytes) -> list[tuple[bool, bytes | str]]:
    """The function on `target`; every rank's (True, pickled result) or (False, error), gathered:
    a rank that fails leaves none waiting."""
    try:
        out = (True, cloudpickle.dumps(cloudpickle.loads(payload)(target)))
    except Exception as e:
        out = (False, f"{type(e).__name__}: {e}")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out, group=control)
    return gathered


class BroadcastingSampler:
    """Rank 0 samples and broadcasts the ids."""

    def __init__(self, inner, tp: TPGroup):
        self.inner, self.tp = inner, tp

    def __call__(self, logits, batch):
        tokens, logprobs = self.inner(logits, batch)
        self.tp.broadcast(tokens, src=0)
        return tokens, logprobs


class ReceivingSampler:
    """A worker's sampler: rank 0's ids, received."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, logits, batch):
        return self.tp.broadcast(torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device), src=0), None


class TPExecutor(Runner):
    """Rank 0's ModelRunner, broadcasting to the workers."""

    def __init__(self, config: EngineConfig, hf_config, model_dir: Path):
        p = config.parallel
        size, per_node = p.tensor_parallel_size, p.tensor_parallel_size // p.nnodes
        addr = p.dist_init_addr or f"127.0.0.1:{free_port()}"
        dev_type = device_type(config)
        self._procs = spawn_workers([(r, r) for r in range(1, per_node)], per_node, size, addr, dev_type)
        self._closed = False
        log.info("tensor parallel: %d ranks (%d per node, %s), waiting at %s", size, per_node, dev_type, addr)
        try:
            self._control = init_group(0, size, addr, dev_type)
            self.tp = TPGroup(0, size, expert_parallel=p.enable_expert_parallel)
            dist.broadcast_object_list([(config, str(model_dir))], src=0, group=self._control)
            self.runner = ModelRunner(rank_config(config, 0), hf_config, model_dir, self.tp)
        except BaseException:
            self._stop_workers(kill=True)
            raise
        atexit.register(self.shutdown)
        self.runner.sampler = BroadcastingSampler(self.runner.sampler, self.tp)
        r = self.runner
        self.device, self.dtype, self.kv_dtype, self.block_size, self.model, self.proposer, self.kv_groups = (
            r.device, r.dtype, r.kv_dtype, r.block_size, r.model, r.proposer, r.kv_groups)

    def _call(self, method: str, *args):
        dist.broadcast_object_list([(method, args)], src=0, group=self._control)
        return run_command(self.runner, self._control, method, args)

    def profile_num_blocks(self, max_blocks: int) -> int:
        return self._call("profile_num_blocks", max_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def build_graphs(self, max_model_len: int, capture: bool = True) -> None:
        self._call("build_graphs", max_model_len, capture)

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()  # every rank holds the same share of the heads

    @property
    def padded_step_sizes(self) -> tuple[int, ...]:
        return self.runner.padded_step_sizes

    @property
    def interpreted(self) -> bool:
        return self.runner.interpreted

    def execute(self, plan):
        return self._call("execute", plan)

    def release(self, request_ids: list[str]) -> None:
        self._call("release", request_ids)

    def add_lora(self, lora: LoRARequest, wait: bool = True) -> None:
        self.runner.add_lora(lora, wait)  # checked on rank 0 first: a bad directory fails here, not in a worker
        dist.broadcast_object_list([("add_lora", (lora, wait))], src=0, group=self._control)

    def remove_lora(self, lora_id: int) -> None:
        self._call("remove_lora", lora_id)

    def stage_loras(self, wanted: list[int], keep: set[int]) -> LoRAStaging:
        """Rank 0's copies say what is ready; a step with nothing to stage sends nothing."""
        lora = self.runner.lora
        if lora is not None and not wanted and lora.settled():
            return lora.staging()
        return self._call("stage_loras", wanted, keep)

    def verify_rows(self) -> int | None:
        return self.runner.verify_rows()

    def draft_cost_ratio(self) -> float:
        return self.runner.draft_cost_ratio()

    def copy_expert_tokens(self):
        return self.runner.copy_expert_tokens()  # rank 0's counters are complete: every rank routes every token

    def reset_expert_tokens(self) -> None:
        self.runner.reset_expert_tokens()

    def apply_model(self, func):
        return self._on_ranks("apply_model", func)

    def collective_rpc(self, func):
        return self._on_ranks("collective_rpc", func)

    def _on_ranks(self, name: str, func) -> list:
        """``func`` travels by cloudpickle; results come back pickled."""
        try:
            payload = cloudpickle.dumps(func)
        except Exception as e:
            raise TypeError(f"{name}: {func!r} cannot be sent to the tensor-parallel workers: {e}") from e
        results = []
        for rank, (ok, out) in enumerate(self._call(name, payload)):
            if not ok:
                raise RuntimeError(f"{name}: {func!r} failed on tensor-parallel rank {rank}: {out}")
            results.append(cloudpickle.loads(out))
        return results

    @property
    def cuda_graph_sizes(self) -> dict[str, tuple[int, ...]]:
        return self.runner.cuda_graph_sizes  # every rank captures the same sizes

    def shutdown(self) -> None:
        """Stop the workers, leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.runner.shutdown()
        try:
            dist.broadcast_object_list([("shutdown", ())], src=0, group=self._control)
        except Exception:  # gone already
            log.warning("tensor parallel: could not tell the workers to stop", exc_info=True)
        self._stop_workers(kill=False)

    def _stop_workers(self, kill: bool) -> None:
        for proc in self._procs:
            if kill:
                proc.kill()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
