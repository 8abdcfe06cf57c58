"""All the engine (and ``LLM``'s inspection methods) may call on what holds the model
(``ModelRunner``, ``TPExecutor``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    import torch
    from torch import nn

    from expresslane.contract import LoRARequest, StepPlan
    from expresslane.runner.expert_load import ExpertTokensCopy
    from expresslane.runner.proposer import Proposer
    from expresslane.runner.step_result import StepResult

    R = TypeVar("R")


@dataclass(slots=True)
class Forward:
    """Forward launched, sampling not yet."""

    plan: StepPlan
    inputs: Any  # the runner's own
    logits: Any  # None: no seq samples
    prompt_logprobs: Any = None  # request id -> ScoredPrompt, on the host
    pooled: Any = None  # runner/pooling.py's PooledVectors


@dataclass(slots=True)
class LoRAStaging:
    ready: set[int]  # adapters a step may use now
    read: dict[int, str | None] = field(default_factory=dict)  # reads finished since: None, or why one failed


class Runner(ABC):
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    model: nn.Module  # this rank's slice
    proposer: Proposer | None  # None: speculation off
    kv_groups: tuple[int | None, ...]  # each KV group's sliding window (None: every key)

    # start-up, in this order
    @abstractmethod
    def profile_num_blocks(self, max_blocks: int) -> int:
        """Fitting every rank, at most ``max_blocks``."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def build_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """``capture=False``: run the graphs' buffers eagerly (CPU tests)."""

    @abstractmethod
    def kv_block_bytes(self) -> int:
        """The draft model's included."""

    @property
    @abstractmethod
    def padded_step_sizes(self) -> tuple[int, ...]:
        """Token counts prefill steps pad to (empty: eager)."""

    @property
    @abstractmethod
    def interpreted(self) -> bool:
        """Under Triton's interpreter (step times mean nothing)."""

    # steps
    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Sampled ids stay on the device until ``StepResult.get()``."""

    def bind_partitions(self, decode_sms: list[int]) -> object | None:
        """None: the lanes take turns."""
        return None

    @property
    def samples_late(self) -> bool:
        """``forward`` and ``sample`` may be called apart."""
        return False

    def forward(self, plan: StepPlan) -> Forward:
        """``plan.token_bitmask`` may be filled before ``sample``."""
        raise NotImplementedError(f"{type(self).__name__} samples with its forward (samples_late is False)")

    def sample(self, step: Forward) -> StepResult:
        raise NotImplementedError(f"{type(self).__name__} samples with its forward (samples_late is False)")

    # LoRA adapters (enable_lora)
    def add_lora(self, lora: LoRARequest, wait: bool = True) -> None:
        """``wait``: read now (ValueError naming the file at fault); else ``stage_loras`` tells."""
        raise ValueError(f"{type(self).__name__} serves no LoRA adapters (tensor_parallel_size 1 only, for now)")

    def remove_lora(self, lora_id: int) -> None:
        """Forget an adapter no request uses any more."""

    @abstractmethod
    def stage_loras(self, wanted: list[int], keep: set[int]) -> LoRAStaging:
        """Load ``wanted`` over slots ``keep`` does not hold."""

    @abstractmethod
    def release(self, request_ids: list[str]) -> None:
        """Forget these requests' rows without a step."""

    # speculative decoding
    @abstractmethod
    def verify_rows(self) -> int | None:
        """Most logits rows a verify step may replay a graph with (None: eager)."""

    @abstractmethod
    def draft_cost_ratio(self) -> float:
        """Draft step cost / target step cost (0: no draft model)."""

    # mixture-of-experts load
    @abstractmethod
    def copy_expert_tokens(self) -> ExpertTokensCopy | None:
        """Start copying per-expert token counts to the host (None: not MoE)."""

    @abstractmethod
    def reset_expert_tokens(self) -> None: ...

    # inspection (``LLM``'s)
    @abstractmethod
    def apply_model(self, func: Callable[[nn.Module], R]) -> list[R]:
        """``func`` on each rank's model, rank 0 first."""

    @abstractmethod
    def collective_rpc(self, func: Callable[["Runner"], R]) -> list[R]:
        """``func`` on each rank's runner, rank 0 first."""

    @property
    @abstractmethod
    def cuda_graph_sizes(self) -> dict[str, tuple[int, ...]]:
        """Captured graphs: ``decode`` (sequences), ``mixed`` (tokens); empty: none."""

    def shutdown(self) -> None:
        """Release worker processes; idempotent."""
