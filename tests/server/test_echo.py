"""`echo` and `prompt_logprobs` through a real server and the official client: the echoed
prompt's logprobs equal the offline engine's prompt logprobs (themselves checked against
transformers in tests/test_prompt_logprobs.py); `max_tokens: 0` returns the prompt alone."""

from __future__ import annotations

import httpx
import pytest

from expresslane import SamplingParams

from .conftest import Server

PROMPT = "The quick brown fox jumps over the lazy dog"
ATOL = 1e-4  # the server's steps and the offline engine's may differ in shape, not in math


def offline(llm, prompt, k: int, **params):
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, prompt_logprobs=k, **params), use_tqdm=False)
    return out


def texts(llm, ids: list[int]) -> list[str]:
    return [llm.tokenizer.decode([t]) for t in ids]


def check_echoed(lp, ref, llm, k: int) -> None:
    """The prompt's part of a completion's logprobs against the offline engine's prompt logprobs."""
    ids = ref.prompt_token_ids
    n = len(ids)
    assert lp.tokens[:n] == texts(llm, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        want = ref.prompt_logprobs[i]
        assert lp.token_logprobs[i] == pytest.approx(want[ids[i]].logprob, abs=ATOL)
        top = {llm.tokenizer.decode([t]): e.logprob for t, e in want.items() if e.rank <= k or t == ids[i]}
        assert lp.top_logprobs[i].keys() == top.keys()
        assert all(lp.top_logprobs[i][s] == pytest.approx(v, abs=ATOL) for s, v in top.items())
    assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]


def test_echo_with_max_tokens_0_is_the_prompt_alone(openai_client, llm):
    ref = offline(llm, PROMPT, 1, max_tokens=1)
    r = openai_client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    [c] = r.choices
    assert c.text == PROMPT and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ref.prompt_token_ids)
    check_echoed(c.logprobs, ref, llm, 1)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ref.prompt_token_ids), 0,
                                                                                       len(ref.prompt_token_ids))


def test_echo_before_a_completion(openai_client, llm):
    ref = offline(llm, PROMPT, 2, max_tokens=6, ignore_eos=True)
    r = openai_client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=6,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    [c] = r.choices
    assert c.text == PROMPT + ref.outputs[0].text
    n = len(ref.prompt_token_ids)
    assert len(c.logprobs.tokens) == n + 6 and c.logprobs.tokens[n:] == texts(llm, ref.outputs[0].token_ids)
    check_echoed(c.logprobs, ref, llm, 2)
    # offsets count over the tokens' texts, the prompt's (its BOS included) then the completion's (vLLM's)
    assert c.logprobs.text_offset == [sum(len(t) for t in c.logprobs.tokens[:i]) for i in range(n + 6)]
    assert r.usage.completion_tokens == 6
    plain = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.0,
                                             extra_body={"ignore_eos": True})
    assert PROMPT + plain.choices[0].text == c.text  # echo changes no token


def test_echo_of_token_ids_and_n(openai_client, llm):
    ids = llm.tokenizer.encode(PROMPT)
    ref = offline(llm, {"prompt_token_ids": ids}, 1, max_tokens=1)
    r = openai_client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3, n=3,
                                         temperature=1.0, seed=3)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.text.startswith(llm.tokenizer.decode(ids))
        check_echoed(c.logprobs, ref, llm, 1)


def test_streamed_echo_with_n_puts_the_prompt_first_in_every_choice(openai_client, llm):
    ref = offline(llm, PROMPT, 1, max_tokens=1)
    n = len(ref.prompt_token_ids)
    chunks = [c.choices[0] for c in openai_client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=4, n=3, temperature=1.0, seed=7, stream=True,
        extra_body={"ignore_eos": True})]
    for index in range(3):
        mine = [c for c in chunks if c.index == index]
        assert mine[0].text.startswith(PROMPT) and not any(c.text.startswith(PROMPT) for c in mine[1:])
        tokens = sum((c.logprobs.tokens for c in mine), [])
        assert tokens[:n] == texts(llm, ref.prompt_token_ids) and len(tokens) == n + 4
        check_echoed(mine[0].logprobs, ref, llm, 1)


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_streamed_echo_equals_the_whole_response(openai_client, max_tokens):
    body = dict(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in openai_client.completions.create(**body, stream=True,
                                                                      stream_options={"include_usage": True})
              if c.choices]
    assert chunks[0].text.startswith(PROMPT)  # the first chunk carries the prompt
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.logprobs.tokens for c in chunks), []) == whole.logprobs.tokens
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == whole.logprobs.token_logprobs
    assert chunks[-1].finish_reason == "length"


def test_stream_of_echo_only_counts_no_completion_tokens(openai_client):
    last = list(openai_client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, stream=True,
                                                 stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens == 0 and last.usage.total_tokens == last.usage.prompt_tokens


def test_prompt_logprobs_field(server, llm):
    ref = offline(llm, PROMPT, 3, max_tokens=2)
    ids = ref.prompt_token_ids
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 3}).json()
    [c] = r["choices"]
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        want = ref.prompt_logprobs[i]
        assert plp[i].keys() == {str(t) for t in want}
        for t, e in want.items():
            got = plp[i][str(t)]
            assert got["logprob"] == pytest.approx(e.logprob, abs=ATOL)
            assert (got["rank"], got["decoded_token"]) == (e.rank, e.decoded_token)
    assert c["text"] == ref.outputs[0].text  # no echo: the text is the completion's


def test_prompt_logprobs_on_chat(server, llm):
    messages = [{"role": "user", "content": "Tell me a story."}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    ref = offline(llm, {"prompt_token_ids": ids}, 0, max_tokens=2)
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, json={
        "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}).json()
    plp = r["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        assert list(plp[i]) == [str(ids[i])]  # top 0: the prompt token alone
        assert plp[i][str(ids[i])]["logprob"] == pytest.approx(ref.prompt_logprobs[i][ids[i]].logprob, abs=ATOL)


@pytest.mark.parametrize("body,param", [
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
])
def test_refused_with_the_field_named(server, body, param):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_generate_refuses_prompt_logprobs(server):
    r = httpx.post(server.url + "/generate", headers=server.headers, json={"prompt": PROMPT, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


@pytest.fixture(scope="module")
def spec_server():
    s = Server("--speculative-method", "ngram", api_key=None)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_speculative_decoding_refuses_echoed_logprobs(spec_server, stream):
    r = httpx.post(spec_server.url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": stream})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert "speculative decoding" in r.json()["error"]["message"]
    ok = httpx.post(spec_server.url + "/v1/completions", timeout=60, json={"prompt": PROMPT, "echo": True,
                                                                          "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith(PROMPT)  # echo without logprobs
