"""The config tree: every user-facing knob, its help and its one default (see flags.py)."""

from expresslane.config.engine import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
    add_cli_args,
    parse_lora_modules,
    engine_kwargs_from_args,
)

__all__ = ["CacheConfig", "DeviceConfig", "EngineConfig", "LoRAConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig",
           "SpeculativeConfig", "StructuredOutputConfig", "add_cli_args", "engine_kwargs_from_args",
           "parse_lora_modules"]
