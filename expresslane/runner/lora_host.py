"""LoRA adapters on the host as a slot holds them (a row of `LoRAState.slots`), read off the
step loop."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from expresslane.contract import LoRARequest
from expresslane.layers.lora import LoRALinear, LoRAState
from expresslane.models.lora_adapter import check_fits, read_adapter

Modules = dict[tuple[int, str], LoRALinear]


def read_host_adapter(lora: LoRARequest, modules: Modules, state: LoRAState, pin: bool) -> torch.Tensor:
    adapter = read_adapter(lora.lora_path, state.max_rank)
    check_fits(adapter, modules)
    by_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, name, part), pair in adapter.weights.items():
        by_module.setdefault((layer, name), {})[part] = pair
    row = torch.zeros(state.slots.shape[1], dtype=state.dtype, pin_memory=pin)
    for key, parts in by_module.items():
        modules[key].write_slot(row, parts)
    return row


class AdapterReader:
    """`wait`: each read is waited for (tensor-parallel ranks stay alike)."""

    def __init__(self, read: Callable[[LoRARequest], torch.Tensor], wait: bool):
        self.read = read
        self.wait = wait
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._reads: list[tuple[LoRARequest, Future]] = []

    def submit(self, lora: LoRARequest) -> None:
        if not any(pending is lora for pending, _ in self._reads):
            self._reads.append((lora, self._pool.submit(self.read, lora)))
        if self.wait:
            self.join()

    @property
    def pending(self) -> bool:
        return bool(self._reads)

    def join(self) -> None:
        wait([future for _, future in self._reads])

    def take(self) -> list[tuple[LoRARequest, torch.Tensor | ValueError]]:
        """The finished reads: the adapter, or the AdapterError naming the file at fault."""
        finished = [(lora, future, future.done()) for lora, future in self._reads]
        self._reads = [(lora, future) for lora, future, done in finished if not done]
        return [(lora, _outcome(future)) for lora, future, done in finished if done]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _outcome(future: Future) -> torch.Tensor | ValueError:
    error = future.exception()
    if error is not None and not isinstance(error, ValueError):
        raise error
    return error if error is not None else future.result()
