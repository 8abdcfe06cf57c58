"""The runner's adapters: registered (id -> directory), on the host (`max_cpu_loras`, LRU) and in
device slots (`max_loras`, LRU; slot 0: none). A step uses only adapters whose copy has finished
(`stage`), so it never waits for a disk read or a copy."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from expresslane.config import LoRAConfig
from expresslane.contract import LoRARequest
from expresslane.layers.lora import LoRAState, LoRAStep
from expresslane.models.lora_adapter import attach_lora
from expresslane.runner.base import LoRAStaging
from expresslane.runner.lora_copies import SlotCopies
from expresslane.runner.lora_host import AdapterReader, read_host_adapter


class LoRASlots:
    def __init__(self, model, config: LoRAConfig, device: torch.device, dtype: torch.dtype, use_triton: bool,
                 wait_reads: bool):
        self.config = config
        self.device = device
        self.state = LoRAState(config.max_loras + 1, config.max_lora_rank, use_triton, dtype)
        self.modules = attach_lora(model, self.state)
        self.registered: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> a slot's row
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free_slots = list(range(config.max_loras, 0, -1))
        self._copying: dict[int, tuple[object, torch.Tensor]] = {}  # id -> (copy's event, source) until used
        self.copies = SlotCopies(device)
        self.reader = AdapterReader(self._read, wait_reads)
        self._reads: dict[int, str | None] = {}  # for the next LoRAStaging
        self.num_loads = 0

    def _read(self, lora: LoRARequest) -> torch.Tensor:
        return read_host_adapter(lora, self.modules, self.state, self.device.type == "cuda")

    def add(self, lora: LoRARequest, wait: bool) -> None:
        host = self._read(lora) if wait else None
        self.remove(lora.lora_int_id)  # the same id again: the new directory wins
        self.registered[lora.lora_int_id] = lora
        if host is None:
            self.reader.submit(lora)
        else:
            self._keep_on_host(lora.lora_int_id, host)

    def remove(self, lora_id: int) -> None:
        self.registered.pop(lora_id, None)
        self.host.pop(lora_id, None)
        self._copying.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def stage(self, wanted: list[int], keep: set[int]) -> LoRAStaging:
        """Runner.stage_loras."""
        self._take_reads()
        protected = set(keep) | set(wanted)
        for lora_id in wanted:
            if lora_id in self.slot_of or lora_id not in self.registered:
                continue
            host = self._host_copy(lora_id)
            if host is None:
                continue
            slot = self._free_slot(protected)
            if slot is None:
                break
            self._load(lora_id, slot, host)
        return self.staging()

    def settled(self) -> bool:
        """No read in flight or untold: `stage([], keep)` would change nothing."""
        return not self._reads and not self.reader.pending

    def staging(self) -> LoRAStaging:
        ready = {i for i in self.slot_of if i not in self._copying or self.copies.done(self._copying[i][0])}
        staging, self._reads = LoRAStaging(ready, self._reads), {}
        return staging

    def _host_copy(self, lora_id: int) -> torch.Tensor | None:
        if lora_id not in self.host:
            self.reader.submit(self.registered[lora_id])
            self._take_reads()
        if lora_id in self.host:
            self.host.move_to_end(lora_id)
        return self.host.get(lora_id)

    def _take_reads(self) -> None:
        for lora, host in self.reader.take():
            lora_id = lora.lora_int_id
            if self.registered.get(lora_id) is not lora:  # removed or replaced since
                continue
            if isinstance(host, ValueError):
                self.remove(lora_id)
                self._reads[lora_id] = str(host)
            else:
                self._keep_on_host(lora_id, host)
                self._reads[lora_id] = None

    def _free_slot(self, protected: set[int]) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((i for i in self.slot_of if i not in protected), None)
        if victim is None:
            return None
        self._copying.pop(victim, None)
        return self.slot_of.pop(victim)

    def _load(self, lora_id: int, slot: int, host: torch.Tensor) -> None:
        target = self.state.slots[slot]
        self._copying[lora_id] = (self.copies.run(slot, lambda: target.copy_(host, non_blocking=True)), host)
        self.slot_of[lora_id] = slot
        self.num_loads += 1

    def prepare(self, token_lora_ids: np.ndarray) -> None:
        """Point the layers at this step's adapters (each token's id, 0: none)."""
        if not token_lora_ids.any():
            self.copies.step(())
            self.state.step = None
            return
        ids = np.unique(token_lora_ids)
        ids = ids[ids != 0]
        if len(ids) > self.config.max_loras:
            raise RuntimeError(f"a step needs {len(ids)} adapters, more than max_loras ({self.config.max_loras})")
        table = np.zeros(int(ids.max()) + 1, dtype=np.int64)
        for lora_id in ids.tolist():
            if lora_id not in self.slot_of:
                raise RuntimeError(f"LoRA adapter id {lora_id} is not staged")
            self.slot_of.move_to_end(lora_id)
            table[lora_id] = self.slot_of[lora_id]
            copy = self._copying.pop(lora_id, None)
            if copy is not None:
                self.copies.wait(copy[0])
        self.copies.step(table[ids].tolist())
        self.state.step = LoRAStep.of(table[token_lora_ids], self.state.num_slots, self.device,
                                      groups=not self.state.use_triton)

    def _keep_on_host(self, lora_id: int, adapter: torch.Tensor) -> None:
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.config.cpu_loras:
            self.host.popitem(last=False)

    def close(self) -> None:
        self.reader.close()
