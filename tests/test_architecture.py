"""The imports run one way (docs/architecture.md): cli -> server and tools -> LLM -> engine ->
scheduler -> runner -> models -> attention/layers, over the leaf modules; no arrow back up and
no cycle. The folders are the tiers: each top-level package or module of expresslane has one
tier, and nothing inside it has another. Every module's imports are read from its source
(lazy, function-level imports included), so a new top-level package or module must be given
a tier here before it can land."""

import ast
import re
import subprocess
from pathlib import Path

import expresslane

ROOT = Path(expresslane.__file__).parent
REPO = ROOT.parent

# one tier per top-level package or module; a module may import its own tier or any lower one
TIERS = {
    "expresslane.cli": (8, "command line"),
    "expresslane.server": (7, "server and tools"),
    "expresslane.router": (7, "server and tools"),  # in front of several servers (data parallelism)
    "expresslane.batch_api": (7, "server and tools"),
    "expresslane.bench": (7, "server and tools"),
    "expresslane.client": (7, "server and tools"),
    "expresslane": (6, "offline entry point"),  # the package's __init__ (LLM)
    "expresslane.entrypoint": (6, "offline entry point"),
    "expresslane.engine": (5, "engine"),
    "expresslane.scheduler": (4, "scheduler"),
    "expresslane.runner": (3, "runner"),
    "expresslane.models": (2, "model"),
    "expresslane.attention": (1, "attention/layers"),
    "expresslane.layers": (1, "attention/layers"),
    "expresslane.quant": (1, "attention/layers"),
    "expresslane.distributed": (1, "attention/layers"),  # the TP group and sharded layers
    # leaves: plain data and helpers every tier may import; they import only leaves
    "expresslane.contract": (0, "leaf"),
    "expresslane.cost_model": (0, "leaf"),
    "expresslane.config": (0, "leaf"),
    "expresslane.lanes": (0, "leaf"),
    "expresslane.sampling_params": (0, "leaf"),
    "expresslane.pooling_params": (0, "leaf"),  # embeddings: the pooler config, a request's pooling parameters
    "expresslane.outputs": (0, "leaf"),
    "expresslane.device": (0, "leaf"),
    "expresslane.cuda_driver": (0, "leaf"),  # libcuda calls torch does not expose (SM splits, green contexts)
    "expresslane.tokenizer": (0, "leaf"),
    "expresslane.backoff": (0, "leaf"),
    "expresslane.child_process": (0, "leaf"),  # how the engine and workers live and die with their parent
    "expresslane.triton_setup": (0, "leaf"),  # Triton for the kernel modules (the interpreter fixed)
}


def tier(module: str) -> tuple[int, str]:
    top = ".".join(module.split(".")[:2])
    assert top in TIERS, f"{module} has no tier: give {top} one in tests/test_architecture.py's TIERS"
    return TIERS[top]


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


GRAPH = {m: imports(m) for m in MODULES}


def test_imports_point_down():
    upward = []
    for module in sorted(MODULES):
        level, name = tier(module)
        for dep in sorted(GRAPH[module]):
            dep_level, dep_name = tier(dep)
            if dep_level > level:
                upward.append(f"{module} ({name}) imports {dep} ({dep_name})")
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle for each import that closes a loop in a depth-first walk (none: the graph is acyclic)."""
    cycles, done, path = [], set(), []

    def visit(m: str) -> None:
        path.append(m)
        for dep in sorted(graph.get(m, ())):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        if m not in done:
            visit(m)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_named_boundaries():
    """The issue's three facts, spelled out (the tiers above imply them)."""
    def reaches(module: str, prefix: str) -> bool:
        seen, todo = set(), [module]
        while todo:
            m = todo.pop()
            if m in seen or m not in MODULES:
                continue
            seen.add(m)
            todo += GRAPH[m]
        return any(m == prefix or m.startswith(prefix + ".") for m in seen - {module})

    runner = [m for m in MODULES if m.startswith("expresslane.runner")]
    assert runner and not any(reaches(m, "expresslane.scheduler") for m in runner)
    assert not reaches("expresslane.config", "expresslane.engine")
    assert not reaches("expresslane.contract", "expresslane.runner")
    assert reaches("expresslane.engine.core", "expresslane.runner")  # the walk sees real edges


def test_every_module_has_a_tier_and_every_tier_a_folder():
    for module in MODULES:
        tier(module)
    assert set(TIERS) == {".".join(m.split(".")[:2]) for m in MODULES}, "TIERS names a package or module that is gone"


def test_architecture_md_names_files_that_exist():
    """Every `path/file.py` or `folder/` docs/architecture.md names is in the repository."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    known = set(files) | {str(Path(f).parent) + "/" for f in files}
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([A-Za-z0-9_./-]+(?:\.py|\.md|\.sh|/))`", text))
    missing = [n for n in sorted(named) if not any(k == n or k.endswith("/" + n) for k in known)]
    assert named and not missing, f"docs/architecture.md names files that do not exist: {missing}"
