"""Runner: what the engine may call on the part that holds the model.

One process's ``ModelRunner`` and rank 0 of a tensor-parallel group (``TPExecutor``) are the
two runners; ``runner/registry.py`` picks one. The engine calls nothing else on a runner:
start-up (KV memory, graphs), one step (``execute`` a plan), and the facts the scheduler and
the cost model need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from expresslane.contract import StepPlan
    from expresslane.runner.expert_load import ExpertTokensCopy
    from expresslane.runner.proposer import Proposer
    from expresslane.runner.step_result import StepResult


@dataclass(slots=True)
class Forward:
    """A step whose forward is launched and whose sampling is not (``Runner.forward``)."""

    plan: StepPlan
    inputs: Any  # the runner's own: what its sampling needs
    logits: Any  # on the device; None when no seq samples
    prompt_logprobs: Any = None  # request id -> ScoredPrompt, on the host; None when no seq scores its prompt


class Runner(ABC):
    device: torch.device
    dtype: torch.dtype  # the model's
    kv_dtype: torch.dtype  # the KV cache's (fp8 with --kv-cache-dtype fp8)
    block_size: int  # tokens per KV block
    model: nn.Module  # this process's model (its slice, with tensor parallelism)
    proposer: Proposer | None  # speculative decoding's proposals (None: it is off)

    # -- start-up, in this order -----------------------------------------------------------------
    @abstractmethod
    def profile_num_blocks(self, max_blocks: int) -> int:
        """How many KV blocks fit (every rank: the smallest count), at most ``max_blocks``."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def build_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """CUDA graphs where the backend allows them; ``capture=False`` runs the same static
        buffers eagerly (tests on CPU)."""

    @abstractmethod
    def kv_block_bytes(self) -> int:
        """Bytes one KV block takes in this process (the draft model's included)."""

    @property
    @abstractmethod
    def padded_step_sizes(self) -> tuple[int, ...]:
        """Token counts a step with prefill is padded to (the graphs' buckets; none when eager)."""

    @property
    @abstractmethod
    def interpreted(self) -> bool:
        """Whether kernels run under Triton's interpreter: step times then say nothing of a device."""

    # -- steps ---------------------------------------------------------------------------------
    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult:
        """Launch one step; its sampled ids stay on the device until ``StepResult.get()``."""

    @property
    def samples_late(self) -> bool:
        """Whether ``forward`` and ``sample`` may be called apart (else only ``execute``)."""
        return False

    def forward(self, plan: StepPlan) -> Forward:
        """Launch a step's forward only; the plan's ``token_bitmask`` may still be filled in
        before ``sample``: the host prepares grammar masks while the device runs the forward."""
        raise NotImplementedError(f"{type(self).__name__} samples with its forward (samples_late is False)")

    def sample(self, step: Forward) -> StepResult:
        """Launch the sampling of a step ``forward`` launched."""
        raise NotImplementedError(f"{type(self).__name__} samples with its forward (samples_late is False)")

    @abstractmethod
    def release(self, request_ids: list[str]) -> None:
        """Forget these requests' rows without a step (after steps run outside the scheduler)."""

    # -- speculative decoding ------------------------------------------------------------------
    @abstractmethod
    def verify_rows(self) -> int | None:
        """The most logits rows a verify step may have and still replay a graph (None: eager)."""

    @abstractmethod
    def draft_cost_ratio(self) -> float:
        """A draft step's cost relative to a target step (0 without a draft model)."""

    # -- mixture-of-experts load ---------------------------------------------------------------
    @abstractmethod
    def copy_expert_tokens(self) -> ExpertTokensCopy | None:
        """Start copying the per-expert token counters to the host (None: not a MoE model)."""

    @abstractmethod
    def reset_expert_tokens(self) -> None: ...

    def shutdown(self) -> None:
        """Release other processes (tensor parallelism's workers); idempotent."""
