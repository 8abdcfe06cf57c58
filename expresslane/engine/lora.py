"""The engine's LoRA adapters: which ids it serves, each one's prefix-cache salt, those being
read, and those waiting to be unloaded until their last request finishes."""

from __future__ import annotations

import itertools
from typing import Iterable

from expresslane.contract import LoRARequest
from expresslane.runner.base import Runner
from expresslane.scheduler.request import Request
from expresslane.scheduler.scheduler import Scheduler


class EngineLoRAs:
    def __init__(self, runner: Runner, enabled: bool):
        self.runner = runner
        self.enabled = enabled
        self.loaded: dict[int, LoRARequest] = {}
        self.unloading: set[int] = set()  # removed, but a request still uses it
        self._salts: dict[int, bytes] = {}
        self._loads = itertools.count(1)  # a salt per load: a reloaded id never hits its old blocks
        self.num_loads = 0
        self.reading: set[int] = set()
        self.read: dict[int, str | None] = {}  # finished: None, or why it failed

    def add(self, lora: LoRARequest, wait: bool = True) -> None:
        """`wait`: read now (ValueError naming the file at fault)."""
        if not self.enabled:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: the engine was started without enable_lora")
        self.runner.add_lora(lora, wait)
        if wait:
            self.num_loads += 1
        else:
            self.reading.add(lora.lora_int_id)
        self.loaded[lora.lora_int_id] = lora
        self._salts[lora.lora_int_id] = f"lora:{lora.lora_int_id}:{next(self._loads)}".encode()
        self.unloading.discard(lora.lora_int_id)

    def bind(self, request: Request, lora: LoRARequest | None) -> None:
        """Give `request` its adapter, loading it if the engine does not hold it yet."""
        if lora is None:
            return
        if lora.lora_int_id not in self.loaded or self.loaded[lora.lora_int_id].lora_path != lora.lora_path:
            self.add(lora, wait=False)
        # (one being unloaded serves this request too, and goes after it)
        request.cache_salt = self._salts[lora.lora_int_id]

    def remove(self, lora_id: int) -> bool:
        """Unload once no request uses it (False: no such adapter)."""
        if lora_id not in self.loaded or lora_id in self.unloading:
            return False
        self.unloading.add(lora_id)
        return True

    def collect(self, in_use: Iterable[Request]) -> None:
        """Unload the adapters waiting for it that no request in `in_use` holds."""
        if not self.unloading:
            return
        for lora_id in self.unloading - {r.lora_id for r in in_use}:
            self.runner.remove_lora(lora_id)
            self._forget(lora_id)

    def _forget(self, lora_id: int) -> None:
        del self.loaded[lora_id], self._salts[lora_id]
        self.unloading.discard(lora_id)
        self.reading.discard(lora_id)

    def stage(self, scheduler: Scheduler) -> dict[int, str]:
        """Before a plan; returns the adapters dropped for a failed read."""
        keep = {r.lora_id for r in scheduler.running.values() if r.lora_id}
        staging = self.runner.stage_loras(list(scheduler.lora_wanted), keep)
        scheduler.lora_ready = staging.ready
        failed = {}
        for lora_id, error in staging.read.items():
            if lora_id in self.reading:
                self.reading.discard(lora_id)
                self.read[lora_id] = error
                self.num_loads += error is None
            if error is not None and lora_id in self.loaded:
                failed[lora_id] = error
                self._forget(lora_id)
        return failed

    def names(self, ids: Iterable[int]) -> str:
        """The adapters' names, sorted and comma-joined (for metrics)."""
        return ",".join(sorted(self.loaded[i].lora_name for i in set(ids) if i in self.loaded))

    def serving(self) -> list[LoRARequest]:
        """The adapters requests may name (not those being unloaded)."""
        return [lora for i, lora in self.loaded.items() if i not in self.unloading]
