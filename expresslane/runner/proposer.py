"""Proposer: where a speculating request's proposals come from (docs/architecture.md, "Speculative decoding").

Two sides. The scheduler asks ``propose`` for each speculating request's proposals (the plan
carries them, or placeholders), ``catch_up`` for the tokens the proposer's own cache lacks, and
tells it, through ``computed_after``, how many of them a verify kept. The runner, in a verify
step, calls ``step_proposals`` for the tokens the target verifies, and sizes and builds the
proposer's memory and graphs beside its own. ``runner/proposer_registry.py`` builds one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from expresslane.runner.request_rows import StepInputs
    from expresslane.sampling_params import SamplingParams


class Proposer(ABC):
    # -- the scheduler's side (host, torch-free) -----------------------------------------------
    @property
    @abstractmethod
    def proposes_on_host(self) -> bool:
        """Whether ``propose`` gives the proposals themselves (else placeholders the runner fills)."""

    @abstractmethod
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposals to follow ``token_ids`` (a request's prompt and output)."""

    @abstractmethod
    def catch_up(self, token_ids: list[int], num_computed: int, start: int) -> list[int]:
        """The tokens before position ``start`` this proposer's cache lacks, of which it holds
        ``num_computed`` (``ScheduledSeq.draft_token_ids``)."""

    @abstractmethod
    def computed_after(self, num_computed: int, accepted: int, k: int) -> int:
        """The tokens its cache holds after a verify from ``num_computed`` kept ``accepted`` of ``k``."""

    # -- the runner's side -----------------------------------------------------------------------
    @abstractmethod
    def kv_block_bytes(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes the proposer's cache takes per KV block of the target's."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None: ...

    @abstractmethod
    def build_graphs(self, max_num_seqs: int, mixed_tokens: int, max_blocks: int, pool: Any,
                     block_size: int) -> None:
        """Its CUDA graphs, captured into ``pool`` (None: the same static buffers, run eagerly)."""

    @abstractmethod
    def cost_ratio(self, target_params: int) -> float:
        """A proposal's cost relative to a target step (0: free)."""

    @abstractmethod
    def step_proposals(self, runner: Any, inputs: StepInputs, spec: np.ndarray, ends: np.ndarray, k: np.ndarray,
                       params: list[SamplingParams], generator: torch.Generator) -> tuple[Any, Any, Any]:
        """A verify step's proposals for its speculating seqs (``spec``: their indices in the step,
        ``ends``: one past each one's last token, ``k``: its proposal count): (tokens [S, max k],
        the distributions q [S, K, V] they were drawn from or None (one-hot), a ``Patch`` of the
        step's input ids or None when the plan carries them)."""
