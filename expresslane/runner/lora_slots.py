"""The runner's adapters: registered (id -> directory), read on the host (the `max_cpu_loras`
most recently used) and in device slots (`max_loras`, least recently used out; slot 0: none).
The scheduler plans at most `max_loras` adapters a step, so a slot can always be freed."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from expresslane.config import LoRAConfig
from expresslane.contract import LoRARequest
from expresslane.layers.lora import LoRALinear, LoRAState, LoRAStep
from expresslane.models.lora_adapter import LoRAAdapter, attach_lora, check_fits, read_adapter


class LoRASlots:
    def __init__(self, model, config: LoRAConfig, device: torch.device, dtype: torch.dtype, use_triton: bool):
        self.config = config
        self.device = device
        self.state = LoRAState(config.max_loras + 1, config.max_lora_rank, use_triton, dtype)
        self.modules: dict[tuple[int, str], LoRALinear] = attach_lora(model, self.state)
        self.registered: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free_slots = list(range(config.max_loras, 0, -1))
        self.num_loads = 0  # adapters copied into a slot

    def add(self, lora: LoRARequest) -> None:
        """AdapterError naming the file at fault."""
        adapter = read_adapter(lora.lora_path, self.config.max_lora_rank)
        check_fits(adapter, self.modules)
        self.remove(lora.lora_int_id)  # the same id again: the new directory wins
        self.registered[lora.lora_int_id] = lora
        self._keep_on_host(lora.lora_int_id, adapter)

    def remove(self, lora_id: int) -> None:
        self.registered.pop(lora_id, None)
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def prepare(self, token_lora_ids: np.ndarray) -> None:
        """Point the layers at this step's adapters (each token's id, 0: none)."""
        if not token_lora_ids.any():
            self.state.step = None
            return
        ids = np.unique(token_lora_ids)
        ids = ids[ids != 0]
        if len(ids) > self.config.max_loras:
            raise RuntimeError(f"a step needs {len(ids)} adapters, more than max_loras ({self.config.max_loras})")
        needed = set(ids.tolist())
        table = np.zeros(int(ids.max()) + 1, dtype=np.int64)
        for lora_id in needed:
            table[lora_id] = self._activate(lora_id, needed)
        self.state.step = LoRAStep.of(table[token_lora_ids], self.state.num_slots, self.device,
                                      groups=not self.state.use_triton)

    def _activate(self, lora_id: int, needed: set[int]) -> int:
        """Its slot; loaded over one this step does not need. Copies queue behind the steps reading the slot."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if lora_id not in self.registered:
            raise RuntimeError(f"LoRA adapter id {lora_id} is not loaded in the runner")
        if not self._free_slots:
            victim = next(i for i in self.slot_of if i not in needed)
            self._free_slots.append(self.slot_of.pop(victim))
        slot = self._free_slots.pop()
        adapter = self.host.get(lora_id)
        if adapter is None:
            adapter = read_adapter(self.registered[lora_id].lora_path, self.config.max_lora_rank)
            check_fits(adapter, self.modules)
        self._keep_on_host(lora_id, adapter)
        by_module: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, name, part), pair in adapter.weights.items():
            by_module.setdefault((layer, name), {})[part] = pair
        for key, module in self.modules.items():
            module.load_slot(slot, by_module.get(key, {}))
        self.slot_of[lora_id] = slot
        self.num_loads += 1
        return slot

    def _keep_on_host(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.config.cpu_loras:
            self.host.popitem(last=False)
