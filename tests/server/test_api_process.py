"""The API process imports no torch (issue #10): only the engine process loads the model."""

from __future__ import annotations

from pathlib import Path

import httpx


def test_the_api_process_has_no_torch_after_serving(server, openai_client):
    openai_client.completions.create(model="tiny", prompt="torch-free", max_tokens=3, logprobs=2)
    openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=server.headers).status_code == 200
    # A module's shared library is mapped once it is imported: torch maps libtorch (and torch/_C).
    api = {line.split()[-1] for line in Path(f"/proc/{server.proc.pid}/maps").read_text().splitlines()
           if "/torch/" in line}
    assert not api, sorted(api)[:5]
    engine = Path(f"/proc/{server.engine_pid()}/maps").read_text()
    assert "/torch/" in engine  # the check sees torch where it is


def test_the_engine_leaves_a_core_to_the_api_process_unless_told():
    from expresslane.server.engine_proc import engine_threads

    assert engine_threads({}, 2) == 1 and engine_threads({}, 16) == 15 and engine_threads({}, 1) == 1
    assert engine_threads({"OMP_NUM_THREADS": "2"}, 2) is None  # the user's setting stands
