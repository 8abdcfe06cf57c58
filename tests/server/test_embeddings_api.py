"""POST /v1/embeddings (and vLLM's /pooling, /score, /rerank) on a real `--runner pooling` server
over a tiny random Qwen2: the vectors equal transformers' own last-token pooling to 1e-5, through
the `openai` SDK (which asks for base64 by default) and LangChain's `OpenAIEmbeddings`; bad fields
are 400s naming them; each kind of server refuses the other's endpoints."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest
import torch
import torch.nn.functional as F
from models import build_model
from openai import BadRequestError, OpenAI

from .conftest import API_KEY, Server, metric

TOL = 1e-5
TEXTS = ["the quick brown fox", "jumps over the lazy dog", "a", "pack my box with five dozen liquor jugs"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("qwen2-embed"))


@pytest.fixture(scope="module")
def embed_server(model_dir, tmp_path_factory):
    # 32-token steps: the longer inputs' prefills are chunked; a batch store for embeddings batches
    store = tmp_path_factory.mktemp("embed-batch") / "store.db"
    s = Server(str(model_dir), "--served-model-name", "tiny", "--runner", "pooling", "--max-num-batched-tokens", "32",
               "--batch-store", f"sqlite:{store}")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(embed_server):
    return OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def token_ids(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


_BASE: dict = {}


def reference(model_dir, ids: list[int], dimensions: int | None = None) -> list[float]:
    """transformers' final hidden state of the last token, (truncated,) normalised."""
    from transformers import AutoModel

    model = _BASE.get(model_dir)
    if model is None:
        model = _BASE[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        v = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return F.normalize(v[:dimensions], dim=-1).tolist()


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= TOL


def test_openai_sdk_equals_transformers(embed_server, client, model_dir):
    res = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 and decodes it
    ids = [token_ids(embed_server, t) for t in TEXTS]
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    for d, i in zip(res.data, ids):
        assert close(d.embedding, reference(model_dir, i))
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    # (a request that runs in other steps, or after a prefix-cache hit, may differ in the last bits)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert all(close(f.embedding, d.embedding) for f, d in zip(floats.data, res.data))
    # token ids in, one list or several; `dimensions` truncates, then normalises
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float").data[0].embedding
    assert close(one, floats.data[0].embedding)
    many = client.embeddings.create(model="tiny", input=ids[:2], encoding_format="float").data
    assert all(close(m.embedding, f.embedding) for m, f in zip(many, floats.data))
    small = client.embeddings.create(model="tiny", input=TEXTS[1], dimensions=8).data[0].embedding
    assert close(small, reference(model_dir, ids[1], 8)) and abs(math.fsum(x * x for x in small) - 1) < 1e-5


def test_metrics_count_embeddings(embed_server, client):
    before = embed_server.metrics()
    client.embeddings.create(model="tiny", input=TEXTS[:3])
    after = embed_server.metrics()

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("expresslane:request_success_total", finished_reason="stop") == 3
    assert grew("expresslane:time_to_first_token_seconds_count") == 3
    assert grew("expresslane:prompt_tokens_total") == sum(len(token_ids(embed_server, t)) for t in TEXTS[:3])


def test_base64_is_little_endian_float32(embed_server):
    body = {"input": "base64 and floats: the same computation"}
    post(embed_server, "/v1/embeddings", body)  # cached now: the two below run alike (each takes the same hit)
    f = post(embed_server, "/v1/embeddings", body).json()
    b = post(embed_server, "/v1/embeddings", {**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == f["data"][0]["embedding"]
    assert f["object"] == "list" and f["data"][0]["object"] == "embedding" and f["model"]


def test_langchain_openai_embeddings(embed_server, client):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain sends the texts. Left on, it splits them with
    # OpenAI's tiktoken encoding (downloaded on first use) and sends those token ids, which mean
    # nothing in this model's vocabulary
    lc = OpenAIEmbeddings(model="tiny", base_url=embed_server.url + "/v1", api_key=API_KEY,
                          check_embedding_ctx_length=False, max_retries=0)
    docs = lc.embed_documents(TEXTS[:2])
    want = [d.embedding for d in client.embeddings.create(model="tiny", input=TEXTS[:2]).data]
    assert all(close(g, w) for g, w in zip(docs, want))
    assert close(lc.embed_query(TEXTS[0]), want[0])


@pytest.mark.parametrize("body, param", [
    ({"input": TEXTS[0], "dimensions": 65}, "dimensions"),  # the hidden size is 64
    ({"input": TEXTS[0], "dimensions": 0}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [[1, 2], [512]]}, "input[1]"),  # outside the vocabulary
    ({"input": TEXTS[0], "encoding_format": "bytes"}, "encoding_format"),
    ({"input": TEXTS[0], "truncate": True}, "truncate"),
    ({"input": list(range(300))}, "input"),  # longer than --max-model-len 256
    ({}, "input"),
    ({"input": TEXTS[0], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": TEXTS[0], "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"input": TEXTS[0], "truncate_prompt_tokens": 257}, "truncate_prompt_tokens"),  # over the context
    ({"input": TEXTS[0], "messages": [{"role": "user", "content": "x"}]}, "input"),  # one or the other
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ({"messages": []}, "messages"),
])
def test_bad_fields_are_named(embed_server, body, param):
    r = post(embed_server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_truncate_prompt_tokens_pools_the_last_tokens(embed_server, client, model_dir):
    """vLLM's truncate_prompt_tokens: each input's last k tokens, as if sent alone; -1 keeps what the
    context holds, so an input longer than the context (refused without it) is pooled too."""
    ids = token_ids(embed_server, TEXTS[3])
    res = client.embeddings.create(model="tiny", input=TEXTS[3], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 3})
    assert close(res.data[0].embedding, reference(model_dir, ids[-3:])) and res.usage.prompt_tokens == 3
    long = [(7 * i) % 500 + 3 for i in range(300)]  # more than --max-model-len 256
    assert post(embed_server, "/v1/embeddings", {"input": long}).status_code == 400
    whole = post(embed_server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1,
                                                  "encoding_format": "float"}).json()
    assert whole["usage"]["prompt_tokens"] == 256 and close(whole["data"][0]["embedding"], reference(model_dir, long[-256:]))


def test_messages_are_embedded_through_the_chat_template(embed_server, model_dir):
    """vLLM's chat embeddings: `messages` through the chat template (no generation prompt by default)
    are one input, pooled as its token ids alone."""
    msgs = [{"role": "system", "content": "Represent the query."}, {"role": "user", "content": TEXTS[0]}]
    ids = post(embed_server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    r = post(embed_server, "/v1/embeddings", {"messages": msgs, "encoding_format": "float"}).json()
    assert r["usage"]["prompt_tokens"] == len(ids) and close(r["data"][0]["embedding"], reference(model_dir, ids))
    cut = post(embed_server, "/v1/embeddings", {"messages": msgs, "truncate_prompt_tokens": 4,
                                                "encoding_format": "float"}).json()
    assert close(cut["data"][0]["embedding"], reference(model_dir, ids[-4:]))


def test_a_batch_of_embeddings_equals_the_requests_alone(embed_server, client):
    """The Batch API's /v1/embeddings lines (OpenAI's) through the openai SDK: each output line's vector
    is the one the route answers; a completions batch on this pooling server is refused by name."""
    import io
    import json
    import time

    rows = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": "tiny", "input": text, "encoding_format": "float"}} for i, text in enumerate(TEXTS)]
    f = client.files.create(file=("embed.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                            purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 120
    while (b := client.batches.retrieve(b.id)).status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b.status == "completed" and b.request_counts.completed == len(TEXTS), b
    lines = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    alone = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float").data
    for line, want in zip(sorted(lines, key=lambda x: x["custom_id"]), alone):
        assert line["response"]["status_code"] == 200
        assert close(line["response"]["body"]["data"][0]["embedding"], want.embedding)
    with pytest.raises(BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["param"] == "endpoint" and "--runner generate" in e.value.body["message"]


def test_pooling_score_rerank(embed_server, client):
    vecs = [d.embedding for d in client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float").data]
    pooled = post(embed_server, "/pooling", {"input": TEXTS[:2]}).json()
    assert [d["data"] for d in pooled["data"]] == vecs[:2] and pooled["data"][0]["object"] == "pooling"

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))  # unit vectors

    score = post(embed_server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert close([d["score"] for d in score["data"]], [cos(vecs[0], v) for v in vecs[1:]])
    pairwise = post(embed_server, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()
    assert close([d["score"] for d in pairwise["data"]], [cos(vecs[0], vecs[2]), cos(vecs[1], vecs[3])])
    assert [d["index"] for d in pairwise["data"]] == [0, 1] and pairwise["data"][0]["object"] == "score"
    r = post(embed_server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
    rerank = post(embed_server, "/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2}).json()
    want = sorted(range(3), key=lambda i: -cos(vecs[0], vecs[i + 1]))[:2]
    assert [x["index"] for x in rerank["results"]] == want
    assert rerank["results"][0]["document"]["text"] == TEXTS[1 + want[0]]
    assert rerank["usage"]["total_tokens"] > 0


def test_a_pooling_server_refuses_generation(embed_server, client):
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.code == "wrong_runner"
    r = post(embed_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "runner pooling" in r.json()["error"]["message"]


def test_a_generation_server_refuses_embeddings(model_dir):
    s = Server(str(model_dir), "--served-model-name", "tiny").wait_ready()
    try:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]}), ("/pooling", {"input": "hi"})):
            r = post(s, path, body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_runner", (path, r.text)
        gen = OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
        assert gen.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
    finally:
        s.stop()
