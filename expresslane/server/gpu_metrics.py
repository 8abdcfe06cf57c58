"""GPU utilisation, memory and power from NVML, sampled in a thread of the API process.

The engine's step loop never waits on it. ``nvidia-ml-py`` is imported only here and
only when the server runs on a GPU; without NVML (a CPU machine, no driver) the GPU
gauges have no samples and nothing else changes. GPUs are the ones the engine can see
(``CUDA_VISIBLE_DEVICES``, by index or UUID), labelled ``gpu`` by their CUDA index.
"""

from __future__ import annotations

import logging
import os
import threading

from expresslane.server.metrics import Metrics

log = logging.getLogger(__name__)


def _visible_handles(nvml) -> list:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    handles = []
    for entry in filter(None, (v.strip() for v in visible.split(","))):
        if entry.isdigit():
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(entry)))
        else:  # GPU-... or MIG-... UUIDs
            handles.append(nvml.nvmlDeviceGetHandleByUUID(entry))
    return handles


class GpuSampler:
    """Sets the ``gpu_*`` gauges every ``interval`` seconds until ``stop()``."""

    def __init__(self, metrics: Metrics, interval: float = 1.0, nvml=None):
        self.metrics = metrics
        self.interval = interval
        self._nvml = nvml
        self._handles: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: set[str] = set()

    def start(self) -> bool:
        """Start sampling; False (and a log line) when NVML is not there."""
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._handles = _visible_handles(self._nvml)
        except Exception as e:  # no package, no driver, no GPU: the GPU gauges stay empty
            log.info("GPU metrics off: NVML unavailable (%s)", e)
            return False
        self.sample()
        self._thread = threading.Thread(target=self._run, name="expresslane-gpu-metrics", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._nvml.nvmlShutdown()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        nvml, m = self._nvml, self.metrics
        for i, h in enumerate(self._handles):
            labels = (m.model_name, str(i))
            # read, then set: a reading that fails leaves its gauge without a sample (never a false 0)
            util = self._read("utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100)
            memory = self._read("memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h))
            watts = self._read("power", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000)
            if util is not None:
                m.gpu_utilization.labels(*labels).set(util)
            if memory is not None:
                m.gpu_memory_used.labels(*labels).set(memory.used)
                m.gpu_memory_total.labels(*labels).set(memory.total)
            if watts is not None:
                m.gpu_power.labels(*labels).set(watts)

    def _read(self, what: str, read):
        try:
            return read()
        except Exception as e:  # e.g. power is not supported on some boards: that gauge stays empty
            if what not in self._unsupported:
                self._unsupported.add(what)
                log.warning("GPU metrics: cannot read %s (%s)", what, e)
            return None
