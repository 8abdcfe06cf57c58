"""LoRA adapters over the OpenAI API (issue #41): the `openai` SDK picks an adapter by `model`,
`/v1/models` lists them with their parent, and vLLM's load/unload routes change them at run time
behind the API key, an adapter in use finishing its requests first."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest
from models import make_lora_adapter
from openai import OpenAI

from expresslane import LLM, LoRARequest, SamplingParams

from .conftest import API_KEY, MAX_MODEL_LEN, Server, metric

pytest.importorskip("peft")

PROMPT = "the quick brown fox"
LONG = 150  # tokens of the stream an unload meets


@pytest.fixture(scope="module")
def adapter_dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"all8": make_lora_adapter(llama_dir, root / "all8", 8, ["q_proj", "v_proj", "o_proj", "down_proj"], seed=1),
            "qv16": make_lora_adapter(llama_dir, root / "qv16", 16, ["q_proj", "v_proj"], True, seed=2),
            "big32": make_lora_adapter(llama_dir, root / "big32", 32, ["q_proj"], seed=3)}


@pytest.fixture(scope="module")
def lora_server(llama_dir, adapter_dirs, tmp_path_factory):
    store = tmp_path_factory.mktemp("batch") / "store.db"
    s = Server(str(llama_dir), "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
               "--lora-modules", f"all8={adapter_dirs['all8']}", "--batch-store", f"sqlite:{store}")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def expected(llama_dir, adapter_dirs):
    """The offline engine's greedy texts (token-exact against transformers: tests/test_lora.py)."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64,
              max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = {None: llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("all8", "qv16"), 1):
        lora = LoRARequest(name, i, str(adapter_dirs[name]))
        out[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    long = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    out["qv16-long"] = llm.generate([PROMPT], long, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    return out


def _complete(client: OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def _post(server: Server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_the_sdk_picks_adapters_by_model(lora_server, expected, llama_dir):
    client = OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    base = str(llama_dir)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "all8"}
    assert cards["all8"].model_extra["parent"] == base
    assert client.models.retrieve("all8").model_extra["parent"] == base
    assert _complete(client, "all8") == expected["all8"]
    assert _complete(client, base) == expected[None]
    assert expected["all8"] != expected[None]
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "nope")
    assert e.value.code == "model_not_found" and "nope" in str(e.value)
    r = _post(lora_server, "/v1/embeddings", {"model": "all8", "input": "hi"})
    assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"]  # pooling: the base model only
    m = lora_server.metrics()
    assert metric(m, "expresslane:lora_requests_info", max_lora="2") > 0
    assert metric(m, "expresslane:lora_adapter_loads_total") >= 1


def test_load_and_unload_at_run_time(lora_server, adapter_dirs, expected, tmp_path):
    client = OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    body = {"lora_name": "qv16", "lora_path": str(adapter_dirs["qv16"])}
    assert _post(lora_server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    r = _post(lora_server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'qv16' added successfully."
    assert _complete(client, "qv16") == expected["qv16"]
    assert {m.id for m in client.models.list().data} >= {"qv16", "all8"}
    again = _post(lora_server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_exists"
    big = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapter_dirs["big32"])})
    assert big.status_code == 400 and "rank 32 is over max_lora_rank 16" in big.json()["error"]["message"]
    (tmp_path / "adapter_config.json").write_text("{}")
    bad = _post(lora_server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_model.safetensors" in bad.json()["error"]["message"]
    assert "big" not in {m.id for m in client.models.list().data}

    # an unload while a stream of that adapter runs: the stream finishes, later requests get 404
    stream = client.completions.create(model="qv16", prompt=PROMPT, max_tokens=LONG, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    r = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "qv16"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'qv16' removed successfully."
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected["qv16-long"]
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        _complete(client, "qv16")
    gone = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "qv16"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"
    # loaded again (a new id), and the adapter from the command line still serves
    assert _post(lora_server, "/v1/load_lora_adapter", body).status_code == 200
    assert _complete(client, "qv16") == expected["qv16"]
    assert _complete(client, "all8") == expected["all8"]


def test_a_load_is_answered_once_its_read_has_finished():
    """The engine process reads a LoadLoRA's adapter off its step loop and answers when the read
    is told finished; a read a request started is nobody's answer."""
    from expresslane.server.engine_proc import _lora, _loaded
    from expresslane.server.wire import LoadLoRA, LoRADone

    class Core:
        reads: dict = {}

        def add_lora(self, lora, wait=True):
            assert not wait, "read off the step loop"

        def take_lora_reads(self):
            reads, self.reads = self.reads, {}
            return reads

    core, loading = Core(), set()
    assert _lora(core, LoadLoRA(LoRARequest("a", 3, "/x")), loading) is None and loading == {3}
    assert _loaded(core, loading) == [], "still reading: no answer yet"
    core.reads = {4: None, 3: "LoRA adapter '/x': no such directory"}
    assert _loaded(core, loading) == [LoRADone("LoRA adapter '/x': no such directory", 400)]
    assert not loading


def test_batch_lines_pick_adapters_by_model(lora_server, expected, llama_dir):
    """The Batch API: each line's model names the served model or an adapter, as a live request's
    does; an unknown one fails that line alone (404 model_not_found in its response)."""
    from server.test_batch_api import wait_batch

    client = OpenAI(base_url=lora_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    rows = [{"custom_id": model, "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
            for model in ("all8", str(llama_dir), "nope")]
    f = client.files.create(file=("loras.jsonl", io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))),
                            purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    assert done.status == "completed"
    lines = {x["custom_id"]: x for x in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    if done.error_file_id:
        lines.update({x["custom_id"]: x for x in map(json.loads,
                                                       client.files.content(done.error_file_id).text.splitlines())})
    assert lines["all8"]["response"]["body"]["choices"][0]["text"] == expected["all8"]
    assert lines["all8"]["response"]["body"]["model"] == "all8"
    assert lines[str(llama_dir)]["response"]["body"]["choices"][0]["text"] == expected[None]
    assert lines["nope"]["response"]["status_code"] == 404
    assert lines["nope"]["response"]["body"]["error"]["code"] == "model_not_found"
