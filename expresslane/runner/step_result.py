"""A launched step's sampled ids on their way to the host."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from expresslane.contract import ScoredPrompt
    from expresslane.runner.pooling import PooledVectors
    from expresslane.runner.spec_verify import Verified


class StepResult:
    """`spec`: (request ids, Verified). On CUDA `get()` waits for the step's end even if
    nothing was sampled: the pipeline stays one step deep."""

    def __init__(self, device: torch.device, request_ids: list[str], tokens: torch.Tensor | None,
                 logprobs: list[dict[int, float]] | None, spec: tuple[list[str], Verified] | None = None,
                 prompt_logprobs: dict[str, ScoredPrompt] | None = None, pooled: PooledVectors | None = None):
        self.request_ids, self.logprobs = request_ids, logprobs
        self._pooled = pooled  # its host copy: the last of `_host`
        self.prompt_logprobs = prompt_logprobs  # request id -> ScoredPrompt, on the host
        self.spec_ids, self._verified = spec if spec else ([], None)
        on_device = (([tokens] if tokens is not None else []) + (self._verified.tensors if spec else [])
                     + ([pooled.vectors] if pooled is not None else []))
        self._event = None
        self._host = on_device
        if device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_device]
            for h, t in zip(self._host, on_device):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """The step has ended (`get` won't wait)."""
        return self._event is None or self._event.query()

    def get(self) -> tuple[dict[str, int | list[int]], dict[str, dict[int, float]] | None]:
        """Each sampling request's token; a speculating request's tokens as a list."""
        if self._event is not None:
            self._event.synchronize()
        if not self._host:
            return {}, None
        host = list(self._host[:-1] if self._pooled is not None else self._host)
        sampled: dict[str, int | list[int]] = {}
        if self.request_ids:
            sampled.update(zip(self.request_ids, host.pop(0).tolist()))
        if self.spec_ids:
            sampled.update(zip(self.spec_ids, self._verified.tokens([t.numpy() for t in host])))
        return sampled, (dict(zip(self.request_ids, self.logprobs)) if self.logprobs is not None else None)

    def pooled(self) -> dict[str, list[float]] | None:
        """Request id -> vector (after ``get``)."""
        return None if self._pooled is None else self._pooled.to_host(self._host[-1])
