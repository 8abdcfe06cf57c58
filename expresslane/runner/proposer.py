"""Where speculative decoding's proposals come from (docs/architecture.md, "Seams")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from expresslane.runner.request_rows import StepInputs
    from expresslane.sampling_params import SamplingParams


class Proposer(ABC):
    # the scheduler's side (torch-free)
    @property
    @abstractmethod
    def proposes_on_host(self) -> bool:
        """Else ``propose`` gives placeholders the runner fills."""

    @abstractmethod
    def propose(self, token_ids: list[int], k: int) -> list[int]: ...

    @abstractmethod
    def catch_up(self, token_ids: list[int], num_computed: int, start: int) -> list[int]:
        """The tokens before ``start`` its cache lacks."""

    @abstractmethod
    def computed_after(self, num_computed: int, accepted: int, k: int) -> int:
        """Its cache after a verify kept ``accepted`` of ``k``."""

    # the runner's side
    @abstractmethod
    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int: ...

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None: ...

    @abstractmethod
    def build_graphs(self, max_num_seqs: int, mixed_tokens: int, max_blocks: int, pool: Any,
                     block_size: int) -> None:
        """``pool`` None: the static buffers, run eagerly."""

    @abstractmethod
    def cost_ratio(self, target_params: int) -> float: ...

    @abstractmethod
    def step_proposals(self, runner: Any, inputs: StepInputs, spec: np.ndarray, ends: np.ndarray, k: np.ndarray,
                       params: list[SamplingParams], generator: torch.Generator) -> tuple[Any, Any, Any]:
        """(tokens [S, max k], q [S, K, V] or None (one-hot), input ids' ``Patch`` or None)."""
