"""The engine reaches the runner only through the Runner interface (runner/base.py), and
every runner implements all of it."""

from __future__ import annotations

import ast
import json
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


def test_the_offline_api_and_the_bench_tools_use_only_the_runner_interface():
    """``LLM``'s inspection methods and ``expresslane bench`` reach the runner through
    ``LLMEngine.runner`` and the Runner interface, not its internals."""
    package = Path(expresslane.__file__).parent
    modules = [package / "entrypoint.py", *sorted((package / "bench").glob("*.py"))]
    used = {(p.name, attr) for p in modules for attr in _runner_attributes(p)}
    assert {("entrypoint.py", "apply_model"), ("entrypoint.py", "shutdown")} <= used  # the walk finds them
    outside = sorted((module, attr) for module, attr in used if attr not in _interface())
    assert not outside, f"past Runner: {outside}"


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


def _attributes_on(path: Path, owner_name: str) -> set[str]:
    """Attributes read on `self.<owner_name>` or a variable `<owner_name>` in one module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == owner_name) or (
                    isinstance(owner, ast.Name) and owner.id == owner_name):
                found.add(node.attr)
    return found


def _callers_outside(base: type, owner_name: str, modules: list[str]) -> list[tuple[str, str]]:
    package = Path(expresslane.__file__).parent
    interface = {n for n, _ in inspect.getmembers(base) if not n.startswith("_")}
    used = {(m, attr) for m in modules for attr in _attributes_on(package / m, owner_name)}
    assert used, f"the walk finds the calls on {owner_name}"
    return sorted((m, attr) for m, attr in used if attr not in interface)


def test_speculation_uses_only_the_proposer_interface():
    from expresslane.runner.proposer import Proposer

    modules = ["scheduler/spec_decode.py", "scheduler/scheduler.py", "runner/model_runner.py", "engine/core.py"]
    assert not _callers_outside(Proposer, "proposer", modules)


def test_both_proposers_implement_the_interface_and_the_registry_builds_them():
    import torch

    from expresslane.config import SpeculativeConfig
    from expresslane.runner.draft_model import DraftModelProposer
    from expresslane.runner.ngram import NgramProposer
    from expresslane.runner.proposer import Proposer
    from expresslane.runner.proposer_registry import make_proposer

    for cls in (NgramProposer, DraftModelProposer):
        assert issubclass(cls, Proposer) and not cls.__abstractmethods__
    draft = Path(expresslane.__file__).parent / "models" / "data" / "stdlib-llama-2m-draft"
    cpu = torch.device("cpu")
    built = [make_proposer(SpeculativeConfig(**kw), 8192, cpu, torch.float32, "torch")
             for kw in ({"speculative_method": "ngram"}, {"speculative_model": str(draft)}, {})]
    assert isinstance(built[0], NgramProposer) and isinstance(built[1], DraftModelProposer) and built[2] is None
    assert built[0].propose([1, 2, 3, 1, 2], 2) == [3, 1] and built[1].propose([1, 2, 3, 1, 2], 2) == [0, 0]


def test_the_engine_uses_only_the_step_cost_model_interface():
    from expresslane.cost_model.base import StepCostModel

    modules = ["scheduler/policy.py", "scheduler/spec_decode.py", "engine/core.py", "server/engine_proc.py"]
    assert not _callers_outside(StepCostModel, "cost_model", modules)


def test_both_cost_models_implement_the_interface_and_the_registry_builds_them(tmp_path):
    from expresslane.cost_model.base import StepCostModel, StepShape
    from expresslane.cost_model.piecewise import NominalStepCostModel, PiecewiseStepCostModel
    from expresslane.cost_model.registry import make_cost_model

    for cls in (PiecewiseStepCostModel, NominalStepCostModel):
        assert issubclass(cls, StepCostModel) and not cls.__abstractmethods__
    fitted = PiecewiseStepCostModel.fit([(StepShape(n), 1e-3 + n * 1e-5) for n in (1, 16, 64, 256)], 256)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(fitted.to_dict()))
    assert make_cost_model("calibrate", 256, lambda: fitted) is fitted
    assert make_cost_model(fitted, 256, None) is fitted  # a value handed in is used as given
    assert isinstance(make_cost_model("nominal", 256, None), NominalStepCostModel)
    assert make_cost_model(str(path), 256, None).to_dict() == fitted.to_dict()
