import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns scalars (stored as shape-(1,) arrays) into loop
    bounds with int(), which numpy >= 2.4 refuses; take the element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_triton_interpreter()

sys.path.insert(0, str(Path(__file__).parent))  # tests/models.py

from models import ARCHS, build_model  # noqa: E402


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


# A real redis-server for the batch store's Redis tests (tests/batch, tests/server).
@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from redis_proc import RedisServer  # imported here: the GPU machine has no redis package

    s = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield s
    finally:
        s.stop()
