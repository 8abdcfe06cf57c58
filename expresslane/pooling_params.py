"""Embeddings (pooling): the model's pooler config and a request's pooling parameters
(torch-free, a leaf).

vLLM's names: ``--runner pooling`` (or its older ``--task embed``) serves a decoder model's
pooled final hidden states instead of sampling; ``--pooler-config`` (or its older
``--override-pooler-config``) is JSON over what the model directory says. A
sentence-transformers directory says it in ``modules.json`` (a ``Normalize`` module means
normalised) and in its Pooling module's ``config.json`` (``1_Pooling/config.json``: which
``pooling_mode_*`` is on). Without either: last-token pooling, normalised (vLLM's default for
``embed``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from expresslane.sampling_params import valid_truncation

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How the engine pools: over which tokens, and whether it normalises by default."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @property
    def needs_whole_prompt(self) -> bool:
        """MEAN and CLS read hidden states a prefix-cache hit would skip: such requests take no hit."""
        return self.pooling_type != "LAST"


@dataclass(slots=True)
class PoolingParams:
    """A pooling request's own parameters (vLLM's): ``dimensions`` keeps the first that many values
    of the pooled vector before normalising (Matryoshka, as OpenAI's ``dimensions``); ``normalize``
    None takes the pooler config's. ``pooling_type`` is the engine's to fill in (the pooler config's).
    ``truncate_prompt_tokens`` (vLLM's): only the input's last k tokens are pooled (-1: as many as
    the model's context holds)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not valid_truncation(self.truncate_prompt_tokens):
            raise ValueError("truncate_prompt_tokens must be an integer >= 1, or -1 for the model's context, got "
                             f"{self.truncate_prompt_tokens!r}")

    def resolved(self, pooler: PoolerConfig, hidden_size: int) -> PoolingParams:
        """A copy with every field set; ValueError naming the field when it does not fit the model."""
        dims = self.dimensions
        if dims is not None and not (isinstance(dims, int) and 1 <= dims <= hidden_size):
            raise ValueError(f"dimensions: must be an integer in [1, {hidden_size}] (the model's hidden size), "
                             f"got {self.dimensions!r}")
        return replace(self, normalize=pooler.normalize if self.normalize is None else bool(self.normalize),
                       pooling_type=pooler.pooling_type)


def sentence_transformers_pooling(model_dir: str | Path) -> dict:
    """The pooler settings a sentence-transformers directory holds ({} when it has none)."""
    root = Path(model_dir)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
        found: dict = {"normalize": any(m.get("type") == _ST_NORMALIZE for m in modules)}
        pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
        if pooling is not None:
            config = json.loads((root / pooling.get("path", "1_Pooling") / "config.json").read_text())
            on = [kind for key, kind in _ST_MODES.items() if config.get(key)]
            other = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            if other or len(on) > 1:
                raise ValueError(f"pooling modes {other or on} are not supported (one of: "
                                 f"{', '.join(_ST_MODES)})")
            if on:
                found["pooling_type"] = on[0]
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{root}: cannot read its sentence-transformers pooling config ({e})") from None
    return found


def parse_pooler_config(text: str | dict | None, flag: str = "pooler_config") -> dict:
    """``--pooler-config`` JSON ({"pooling_type": "MEAN", "normalize": false}) as a checked dict."""
    if text is None:
        return {}
    try:
        given = json.loads(text) if isinstance(text, str) else dict(text)
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{flag}: not a JSON object ({e})") from None
    if not isinstance(given, dict):
        raise ValueError(f"{flag}: must be a JSON object, got {text!r}")
    unknown = sorted(set(given) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {unknown}; known: pooling_type, normalize")
    if "pooling_type" in given:
        kind = str(given["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"{flag}: pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{given['pooling_type']!r}")
        given["pooling_type"] = kind
    if "normalize" in given and not isinstance(given["normalize"], bool):
        raise ValueError(f"{flag}: normalize must be true or false, got {given['normalize']!r}")
    return given


def pooler_config(model_dir: str | Path, *overrides: str | dict | None) -> PoolerConfig:
    """The model directory's pooler settings, then each override in turn (later wins)."""
    settings = sentence_transformers_pooling(model_dir)
    for text in overrides:
        settings.update(parse_pooler_config(text))
    return PoolerConfig(**settings)


def resolve_runner(runner: str, task: str | None, architectures: list[str], model_dir: str | Path) -> str:
    """generate or pooling. auto: pooling for an architecture named ``*Model`` (a base model, no
    language-model head) or a sentence-transformers directory, else generate."""
    if task is not None:
        wanted = {"generate": "generate", "embed": "pooling"}.get(task)
        if wanted is None:
            raise ValueError(f"task must be generate or embed, got {task!r}")
        if runner not in ("auto", wanted):
            raise ValueError(f"task {task!r} and runner {runner!r} disagree")
        return wanted
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner != "auto":
        return runner
    if any(a.endswith("Model") and not a.endswith("ForCausalLM") for a in architectures):
        return "pooling"
    return "pooling" if "pooling_type" in sentence_transformers_pooling(model_dir) else "generate"
