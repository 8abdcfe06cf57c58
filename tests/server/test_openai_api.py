"""The OpenAI API through the official client: outputs equal the offline engine's."""

from __future__ import annotations

import json

import httpx
import pytest

from expresslane import SamplingParams

from .conftest import API_KEY, MAX_MODEL_LEN, metric

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


def offline(llm, prompt, **params):
    [out] = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return out


def chat_ids(llm) -> list[int]:
    text = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_completion_greedy_equals_offline_with_usage(openai_client, llm):
    ref = offline(llm, PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    r = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(openai_client, llm, server):
    """vLLM's truncate_prompt_tokens: the completion and the chat of a prompt's last k tokens, as the
    offline engine gives them for those tokens alone; 0 and more than the context are 400s naming it."""
    ids = llm.tokenizer.encode(PROMPT * 4)
    ref = offline(llm, {"prompt_token_ids": ids[-5:]}, max_tokens=6, temperature=0.0, ignore_eos=True)
    r = openai_client.completions.create(model="tiny", prompt=PROMPT * 4, max_tokens=6, temperature=0.0,
                                         extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == ref.outputs[0].text
    chat = chat_ids(llm)
    ref = offline(llm, {"prompt_token_ids": chat[-7:]}, max_tokens=6, temperature=0.0, ignore_eos=True)
    c = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.0,
                                              extra_body={"ignore_eos": True, "truncate_prompt_tokens": 7})
    assert c.usage.prompt_tokens == 7 and c.choices[0].message.content == ref.outputs[0].text
    for bad in (0, MAX_MODEL_LEN + 1):
        resp = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                          json={"model": "tiny", "prompt": PROMPT, "truncate_prompt_tokens": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens", resp.text


def test_completion_stream_with_usage_equals_offline(openai_client, llm):
    ref = offline(llm, PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True)
    chunks = list(openai_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_and_stream_equal_offline(openai_client, llm):
    ref = offline(llm, {"prompt_token_ids": chat_ids(llm)}, max_tokens=10, temperature=0.0, ignore_eos=True)
    r = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0.0,
                                              extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 10
    chunks = list(openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_n2_seeded_is_reproducible_and_matches_offline(openai_client, llm):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=1234)
    a = openai_client.completions.create(**kw)
    b = openai_client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # children get seed + i
    ref = offline(llm, PROMPT, max_tokens=8, temperature=1.0, n=2, seed=1234)
    assert [c.text for c in a.choices] == [c.text for c in ref.outputs]
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)
    streamed = {0: "", 1: ""}
    for chunk in openai_client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in a.choices]


def test_stop_string_cuts_text_streamed_or_not(openai_client, llm):
    full = offline(llm, PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True).outputs[0].text
    stop = full[5:8]  # spans a token boundary in general: the stream must hold text back
    expected = full[:full.index(stop)]
    r = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.0,
                                                   stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_batched_prompts_and_logprobs(openai_client, llm):
    prompts = ["One two three", "Alpha beta"]
    r = openai_client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0.0, n=2,
                                         logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    refs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [c.text for c in r.choices] == [refs[0].outputs[0].text] * 2 + [refs[1].outputs[0].text] * 2
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)


def test_prefix_cache_hit_reported_as_cached_tokens(openai_client):
    prompt = "A long shared prefix that fills more than a couple of KV blocks. " * 4
    openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    r = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_generate_json_and_stream(server, llm):
    ref = offline(llm, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True).outputs[0]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(server.url + "/generate", json=body, headers=server.headers).json()
    assert (r["text"], r["token_ids"], r["finish_reason"]) == (ref.text, ref.token_ids, "length")
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, headers=server.headers) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    assert "".join(e["text"] for e in events) == ref.text
    assert sum((e["token_ids"] for e in events), []) == ref.token_ids


def test_the_sdk_lists_and_retrieves_the_model(openai_client):
    import openai

    assert [m.id for m in openai_client.models.list()] == ["tiny"]
    assert openai_client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-4o")


def test_info_endpoints(server, llm):
    h = server.headers
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/version").json()["version"]
    models = httpx.get(server.url + "/v1/models", headers=h).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    assert httpx.get(server.url + "/v1/models/tiny", headers=h).json() == models["data"][0]
    missing = httpx.get(server.url + "/v1/models/org/other", headers=h)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", missing.text
    tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert tok["tokens"] == llm.tokenizer.encode(PROMPT) and tok["count"] == len(tok["tokens"])
    tok = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, headers=h).json()
    assert tok["tokens"] == chat_ids(llm)
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()["prompt"]


def test_metrics_names_lanes_and_return_metrics(server, openai_client):
    before = server.metrics()
    r = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body={
        "lane": "batch", "priority": 3, "ignore_eos": True, "return_metrics": True})
    m = r.model_extra["metrics"]
    assert m["arrival_time"] <= m["engine_arrival_time"] <= m["first_token_time"] <= m["finished_time"]
    after = server.metrics()
    assert metric(after, "expresslane:generation_tokens_total", lane="batch") - \
        metric(before, "expresslane:generation_tokens_total", lane="batch") == 3
    assert metric(after, "expresslane:request_success_total", lane="batch", finished_reason="length") == \
        metric(before, "expresslane:request_success_total", lane="batch", finished_reason="length") + 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert metric(after, f"expresslane:{name}_count", lane="batch") >= 1, name
        assert f'expresslane:{name}_bucket{{lane="batch",le="0.001",model_name="tiny"}}' in after, name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "iteration_tokens_total_count",
                 "batch_size_count", "step_duration_seconds_count", "step_time_seconds_count",
                 "step_time_predicted_seconds_count"):
        assert any(k.startswith(f"expresslane:{name}") for k in after), name


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_open_endpoints_need_no_key(server, path):
    assert httpx.get(server.url + path).status_code == 200


def test_api_key_is_required_elsewhere(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server):
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=60, json={
            "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
