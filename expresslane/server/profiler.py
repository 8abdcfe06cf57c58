"""On-demand torch profiler traces of the engine process (``--profile-dir``; ``POST /start_profile``).

Runs inside the engine process, between its steps: ``start`` begins recording every
step's CPU work (and CUDA kernels on a GPU), ``stop`` ends it and writes one Chrome
trace (JSON: chrome://tracing, Perfetto, TensorBoard) into the directory. torch is
imported here only, and only when a profile starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class ProfileError(Exception):
    """A start while profiling or a stop while not: the caller's mistake, not the engine's."""


class EngineProfiler:
    def __init__(self, directory: str):
        self.directory = Path(directory)
        self._profile = None
        self._count = 0

    def start(self) -> None:
        if self._profile is not None:
            raise ProfileError("a profile is already running; POST /stop_profile first")
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()

    def stop(self) -> str:
        """End the profile and write its trace; returns the trace's path."""
        if self._profile is None:
            raise ProfileError("no profile is running; POST /start_profile first")
        profile, self._profile = self._profile, None
        profile.stop()
        self._count += 1
        path = self.directory / f"engine-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._count}.json"
        profile.export_chrome_trace(str(path))
        return str(path)
