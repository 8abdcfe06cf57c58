"""The imports run one way (docs/architecture.md): server -> engine -> {scheduler, kv} ->
runner -> model -> attention/layers, over shared leaf modules; no arrow back up. Every
module's imports are read from its source (lazy, function-level imports included), so
a new module must be given a tier here before it can land."""

import ast
from pathlib import Path

import expresslane

ROOT = Path(expresslane.__file__).parent

# longest matching prefix wins; a module may import its own tier or any lower one
TIERS = [
    ("expresslane.cli", 8, "command line"),
    ("expresslane.server", 7, "server"),
    ("expresslane.batch", 7, "server"),
    ("expresslane.bench", 7, "server"),
    ("expresslane.client", 7, "server"),
    ("expresslane.router", 7, "server"),  # in front of several servers (data parallelism)
    ("expresslane", 6, "offline entry point"),  # the package itself (LLM); exact match only
    ("expresslane.entrypoint", 6, "offline entry point"),
    ("expresslane.engine", 5, "engine"),
    ("expresslane.scheduler", 4, "scheduler/kv"),
    ("expresslane.runner", 3, "runner"),
    ("expresslane.models", 2, "model"),
    ("expresslane.attention", 1, "attention/layers"),
    ("expresslane.layers", 1, "attention/layers"),
    ("expresslane.quant", 1, "attention/layers"),
    ("expresslane.distributed", 1, "attention/layers"),  # the TP group and sharded layers
    # leaves: plain data and helpers every tier may import; they import only leaves
    ("expresslane.contract", 0, "leaf"),
    ("expresslane.cost_model", 0, "leaf"),
    ("expresslane.config", 0, "leaf"),
    ("expresslane.lanes", 0, "leaf"),
    ("expresslane.sampling_params", 0, "leaf"),
    ("expresslane.outputs", 0, "leaf"),
    ("expresslane.device", 0, "leaf"),
    ("expresslane.tokenizer", 0, "leaf"),
    ("expresslane.backoff", 0, "leaf"),
    ("expresslane.child_process", 0, "leaf"),  # how the engine and workers live and die with their parent
    ("expresslane.triton_setup", 0, "leaf"),  # Triton for the kernel modules (the interpreter fixed)
]


def tier(module: str) -> tuple[int, str]:
    matches = [p for p in TIERS if module == p[0] or (p[0] != "expresslane" and module.startswith(p[0] + "."))]
    assert matches, f"{module} has no tier: place it in tests/test_architecture.py's TIERS"
    best = max(matches, key=lambda p: len(p[0]))
    return best[1], best[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(module: str) -> set[str]:
    """The expresslane modules `module` imports (`from pkg import mod` counts as pkg.mod)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "expresslane"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("expresslane"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {node.module}
    return found - {module}


def test_imports_point_down():
    upward = []
    for module in sorted(MODULES):
        level, name = tier(module)
        for dep in sorted(imports(module)):
            dep_level, dep_name = tier(dep)
            if dep_level > level:
                upward.append(f"{module} ({name}) imports {dep} ({dep_name})")
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_the_named_boundaries():
    """The issue's three facts, spelled out (the tiers above imply them)."""
    def reaches(module: str, prefix: str) -> bool:
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m in seen or m not in MODULES:
                continue
            seen.add(m)
            todo += imports(m)
        return any(m == prefix or m.startswith(prefix + ".") for m in seen - {module})

    runner = [m for m in MODULES if m.startswith("expresslane.runner")]
    assert runner and not any(reaches(m, "expresslane.scheduler.scheduler") for m in runner)
    assert not reaches("expresslane.config", "expresslane.engine")
    assert not reaches("expresslane.contract", "expresslane.runner")
    assert reaches("expresslane.engine.core", "expresslane.runner")  # the walk sees real edges


def test_every_module_has_a_tier():
    for module in MODULES:
        tier(module)
