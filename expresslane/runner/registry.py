"""The engine's Runner: a ModelRunner, or rank 0 of a tensor-parallel group."""

from __future__ import annotations

from pathlib import Path

from expresslane.config import EngineConfig
from expresslane.runner.base import Runner
from expresslane.runner.model_runner import ModelRunner
from expresslane.runner.tensor_parallel import TPExecutor, check_splits


def make_runner(config: EngineConfig, hf_config, model_dir: Path) -> Runner:
    p = config.parallel
    if p.tensor_parallel_size == 1:
        return ModelRunner(config, hf_config, model_dir)
    if p.node_rank != 0:
        raise ValueError(f"node_rank {p.node_rank} runs workers only: start it with "
                         "`expresslane serve --node-rank N ...`; node 0 runs the engine")
    check_splits(config, hf_config)
    return TPExecutor(config, hf_config, model_dir)
