"""LoRA adapters behind the router (issue #41 with data parallelism): a load or an unload sent to
the router reaches every replica, so requests naming the adapter are served right wherever
they land; a load one replica refuses is refused as a whole; a replica that was down when an
adapter was loaded gets it when it comes up."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from models import make_lora_adapter
from openai import OpenAI
from server.conftest import API_KEY, MAX_MODEL_LEN, Server, free_port

from expresslane import LLM, LoRARequest, SamplingParams

from .conftest import router

pytest.importorskip("peft")

PROMPTS = [f"adapter request {i} " * 4 for i in range(8)]
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory):
    return make_lora_adapter(llama_dir, tmp_path_factory.mktemp("adapters") / "qv8", 8, ["q_proj", "v_proj"], seed=5)


@pytest.fixture(scope="module")
def rank16(llama_dir, tmp_path_factory):
    return make_lora_adapter(llama_dir, tmp_path_factory.mktemp("adapters") / "o16", 16, ["o_proj"], seed=6)


@pytest.fixture(scope="module")
def expected(llama_dir, adapter):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64,
              max_model_len=MAX_MODEL_LEN)
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                       lora_request=LoRARequest("qv8", 1, str(adapter)))
    return [o.outputs[0].text for o in out]


def post(url: str, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def complete(url: str, model: str, prompt: str) -> str:
    client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0,
                                  extra_body={"ignore_eos": True, "lane": "batch"})
    return r.choices[0].text


def test_loads_reach_every_replica_and_one_that_comes_back(llama_dir, adapter, rank16, expected, tmp_path):
    first = Server(str(llama_dir), *LORA_ARGS)
    late_port = free_port()  # the second replica starts only after the load
    front = router([first.url, f"http://127.0.0.1:{late_port}"])
    late = None
    try:
        first.wait_ready()
        front.wait_ready()
        body = {"lora_name": "qv8", "lora_path": str(adapter)}
        assert post(front.url, "/v1/load_lora_adapter", body, key=None).status_code == 401
        r = post(front.url, "/v1/load_lora_adapter", body)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'qv8' added successfully.", r.text
        bad = post(front.url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]

        late = Server(str(llama_dir), *LORA_ARGS, "--max-lora-rank", "8", port=late_port).wait_ready()
        deadline = time.monotonic() + 120  # a hang guard, not a figure: the router polls every 0.5 s
        while httpx.get(front.url + "/health").json()["replicas"][late.url] != "ready":  # (synced before)
            assert time.monotonic() < deadline, "the router never saw the second replica"
            time.sleep(0.1)
        # the late replica got the load from the router on its return: asked directly, it serves it
        assert complete(late.url, "qv8", PROMPTS[0]) == expected[0]
        for s in (first, late):
            models = httpx.get(s.url + "/v1/models", headers=s.headers).json()["data"]
            assert "qv8" in {m["id"] for m in models} and "bad" not in {m["id"] for m in models}

        with ThreadPoolExecutor(4) as pool:  # batch lane: spread over both replicas by the router's count
            texts = list(pool.map(lambda p: complete(front.url, "qv8", p), PROMPTS))
        assert texts == expected
        served = [sum(v for k, v in s.metrics().items()
                      if k.startswith("expresslane:request_success_total{") and 'lane="batch"' in k)
                  for s in (first, late)]
        assert all(n > 0 for n in served), served

        # rank 16: the first replica takes it, the late one (--max-lora-rank 8) refuses; refused as a whole
        r = post(front.url, "/v1/load_lora_adapter", {"lora_name": "o16", "lora_path": str(rank16)})
        assert r.status_code == 400 and "rank 16 is over max_lora_rank 8" in r.json()["error"]["message"], r.text
        for s in (first, late):
            assert "o16" not in {m["id"] for m in httpx.get(s.url + "/v1/models", headers=s.headers).json()["data"]}

        r = post(front.url, "/v1/unload_lora_adapter", {"lora_name": "qv8"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'qv8' removed successfully."
        for url in (front.url, first.url, late.url):
            with pytest.raises(openai.NotFoundError):
                complete(url, "qv8", PROMPTS[0])
        gone = post(front.url, "/v1/unload_lora_adapter", {"lora_name": "qv8"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    finally:
        for proc in (front, first, late):
            if proc is not None:
                proc.stop()
