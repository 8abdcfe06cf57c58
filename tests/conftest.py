import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # expresslane.triton_setup fixes the interpreter

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
