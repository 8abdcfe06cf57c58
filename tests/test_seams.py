"""The engine reaches the runner only through the Runner interface (runner/base.py), and
every runner implements all of it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import expresslane
from expresslane.runner.base import Runner
from expresslane.runner.model_runner import ModelRunner
from expresslane.runner.tensor_parallel import TPExecutor

ENGINE = Path(expresslane.__file__).parent / "engine"


def _interface() -> set[str]:
    names = {n for n, _ in inspect.getmembers(Runner) if not n.startswith("_")}
    return names | set(Runner.__annotations__)


def _runner_attributes(path: Path) -> set[str]:
    """Attributes read on `self.runner` (or a `runner` parameter) in one module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == "runner") or (
                    isinstance(owner, ast.Name) and owner.id == "runner"):
                found.add(node.attr)
    return found


def test_the_engine_uses_only_the_runner_interface():
    used = {(p.name, attr) for p in ENGINE.glob("*.py") for attr in _runner_attributes(p)}
    step_timing = Path(expresslane.__file__).parent / "runner" / "step_timing.py"
    used |= {(step_timing.name, attr) for attr in _runner_attributes(step_timing)}
    assert used, "the walk finds the engine's calls"
    outside = sorted((module, attr) for module, attr in used if attr not in _interface())
    assert not outside, f"the engine reaches past Runner: {outside}"


def test_every_runner_implements_the_interface():
    for cls in (ModelRunner, TPExecutor):
        assert issubclass(cls, Runner)
        assert not getattr(cls, "__abstractmethods__", None), (cls, cls.__abstractmethods__)
        assert "__getattr__" not in vars(cls)  # no proxy: what it offers, it declares


def test_every_attention_backend_implements_the_interface():
    from expresslane.attention.backend import AttentionBackend
    from expresslane.attention.torch_backend import TorchAttentionBackend
    from expresslane.attention.triton_backend import TritonAttentionBackend

    for cls in (TorchAttentionBackend, TritonAttentionBackend):
        assert issubclass(cls, AttentionBackend) and not cls.__abstractmethods__
        if cls.supports_cuda_graphs:  # the graphs' hooks are its own, not the base's refusals
            for hook in ("prefill_tile", "max_prefill_work", "plan_prefill"):
                assert getattr(cls, hook) is not getattr(AttentionBackend, hook), (cls, hook)
