import os
import sys
from pathlib import Path

# One torch (OpenMP) thread per process, servers and engines the tests start included (they
# inherit it): on a 2-core machine those processes run side by side, and OpenMP threads that
# spin while another process holds the other core made torch-heavy tests up to 13x slower (a
# quantized one-batch test: 66 s, 5 s with one thread; a 512^3 matmul 7.9 ms vs 1.7 ms).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every engine the tests start, servers included (they inherit it), sizes its steps with the fixed
# nominal step-cost model: the deadline policy's decisions do not depend on this machine's speed.
# A test of the calibrated model passes step_cost_model="calibrate".
os.environ.setdefault("EXPRESSLANE_STEP_COST_MODEL", "nominal")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # expresslane.triton_setup fixes the interpreter

sys.path.insert(0, str(Path(__file__).parent))  # tests/models.py

from models import ARCHS, build_model  # noqa: E402

# The longest test files (docs/performance.md, "CI time"), collected first: .ci/run's pytest-xdist
# hands whole files (--dist loadfile) to its workers in collection order, so a long file collected
# last keeps one worker busy after the other has finished.
LONGEST_FILES = ("test_equivalence.py", "test_deepseek.py", "test_spec_decode.py", "test_tensor_parallel.py",
                 "test_gpt_oss.py", "test_sliding_window.py", "server/test_batch_durability.py",
                 "router/test_data_parallel.py", "reliability/test_sigterm.py", "test_gemma.py", "test_lora.py",
                 "bench/test_doctor.py", "reliability/test_schemathesis.py")


def pytest_collection_modifyitems(items):
    tests = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))  # stable


@pytest.fixture(scope="session")
def flat_sim():
    """benchmarks/flat_sim.py as a module (the benchmarks are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flat_sim", Path(__file__).parents[1] / "benchmarks" / "flat_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Presets the tests build and the batch stores of servers started without `--batch-store`
    go to a directory of this run (servers inherit it), not the user's ~/.cache/expresslane,
    which two xdist workers and every past run shared. An explicit EXPRESSLANE_CACHE stays."""
    if os.environ.get("EXPRESSLANE_CACHE"):
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("EXPRESSLANE_CACHE", str(tmp_path_factory.mktemp("expresslane-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


# A real redis-server for the batch store's Redis tests (tests/batch_api, tests/server).
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from redis_proc import RedisServer  # imported here: the GPU machine has no redis package

    s = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield s
    finally:
        s.stop()
