"""The config tree's sections of the small commands: the global log level, ``make-model``
and ``generate`` (flags.py makes their flags)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from expresslane.config.flags import _knob


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    log_level: str = _knob("WARNING", "logging level (DEBUG, INFO, WARNING, ...)")


@dataclass(frozen=True, slots=True)
class MakeModelConfig:
    seed: int = _knob(0, "seed of the random weights")
    device: str = _knob("cpu", "where to generate the weights (cuda is much faster)")
    quantization: str | None = _knob(None, "write the decoder layers' weights quantized: fp8 (compressed-tensors, "
                                     "per-channel e4m3), awq or gptq (4-bit, group size 128)", ("fp8", "awq", "gptq"))
    no_weights: bool = _knob(False, "write the config and tokenizer only; serve it with --load-format dummy (the "
                             "engine generates the same weights on its device)", negatable=False)


@dataclass(frozen=True, slots=True)
class QuantizeConfig:
    quantization: str = _knob(MISSING, "the format of the decoder layers' weights: fp8 (compressed-tensors, "
                              "per-channel e4m3), awq or gptq (4-bit, group size 128); rounded to nearest",
                              ("fp8", "awq", "gptq"))


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    """One request of ``generate`` (the command's own defaults: greedy, 64 tokens)."""

    prompt: str = _knob(MISSING, "the prompt")
    chat: bool = _knob(False, "wrap the prompt in the model's chat template", negatable=False)
    max_tokens: int = _knob(64, "tokens to generate at most")
    temperature: float = _knob(0.0, "0 is greedy")
    top_p: float = _knob(1.0, "nucleus sampling: the smallest set of tokens with this much probability")
    top_k: int = _knob(0, "sample among the k likeliest tokens (0: all)")
    min_p: float = _knob(0.0, "drop tokens below this fraction of the likeliest one's probability")
    sampling_seed: int | None = _knob(None, "seed of this request's sampler")
    stop: tuple[str, ...] = _knob((), "stop string (repeatable)", repeat=True)
    ignore_eos: bool = _knob(False, "generate max_tokens tokens, past EOS", negatable=False)
    n: int = _knob(1, "number of completions", flag="-n")
