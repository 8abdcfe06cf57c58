"""gpt-oss's harmony format through the server with the openai SDK: the tokenizer directory's
chat template renders the prompt, and the output's channels split into reasoning_content
(analysis), content (final) and tool_calls (commentary to=functions.NAME), in messages and
stream deltas. A tiny random gpt-oss is held by a regex to write harmony (its markers as
special tokens or spelled out, as the model picks: both count)."""

from __future__ import annotations

import json

import pytest
from models import build_model
from openai import OpenAI

from expresslane.server import harmony
from expresslane.server.harmony import HarmonyStream, messages, parts

from .conftest import API_KEY, Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
M = r"<\|message\|>"
ANSWER = (rf"<\|channel\|>analysis{M}[a-z]{{2,6}} [a-z]{{2,6}}<\|end\|><\|start\|>assistant<\|channel\|>final{M}"
          r"[A-Z][a-z]{2,6}\.")
CALL = (rf"<\|channel\|>analysis{M}[a-z]{{2,6}}<\|end\|><\|start\|>assistant<\|channel\|>commentary "
        rf'to=functions\.get_weather <\|constrain\|>json{M}\{{"city": "[A-Z][a-z]{{2,6}}"\}}<\|call\|>')


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    return build_model("gpt_oss", tmp_path_factory.mktemp("oss") / "gpt_oss")


@pytest.fixture(scope="module")
def oss_server(oss_dir):
    # the tests' regexes make the random model write harmony, channels included: a grammar that
    # holds the whole output (by default it holds the answer's message only)
    s = Server(str(oss_dir), "--served-model-name", "oss", "--max-model-len", "1024",
               "--structured-outputs-enable-in-reasoning").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(oss_server):
    return OpenAI(base_url=oss_server.url + "/v1", api_key=API_KEY, max_retries=0)


def _stream(client, **kwargs) -> tuple[str, str, dict, str]:
    thought = content = ""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return thought, content, calls, finish


def test_channels_split_into_reasoning_and_content(client):
    kwargs = dict(model="oss", messages=MESSAGES, max_tokens=120, temperature=0, extra_body={"guided_regex": ANSWER})
    choice = client.chat.completions.create(**kwargs).choices[0]
    thought, answer = choice.message.model_extra["reasoning_content"], choice.message.content
    assert len(thought.split()) == 2 and thought.islower() and answer[0].isupper() and answer.endswith(".")
    assert "<|" not in answer and choice.finish_reason == "stop"
    assert _stream(client, **kwargs) == (thought, answer, {}, "stop")


def test_commentary_to_a_function_is_a_tool_call(client):
    kwargs = dict(model="oss", messages=MESSAGES, tools=[WEATHER], max_tokens=160, temperature=0,
                  extra_body={"guided_regex": CALL})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    thought, content, calls, finish = _stream(client, **kwargs)
    assert (thought, content, finish) == (choice.message.model_extra["reasoning_content"], "", "tool_calls")
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # the call and its result go back through the template; the next turn answers
    history = MESSAGES + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model="oss", messages=history, tools=[WEATHER], max_tokens=120,
                                           temperature=0, extra_body={"guided_regex": ANSWER}).choices[0]
    assert again.finish_reason == "stop" and again.message.content


def test_the_template_renders_harmony(oss_dir):
    from transformers import AutoTokenizer

    from expresslane.server.serving import chat_prompt
    from expresslane.server.protocol import ChatMessage

    tok = AutoTokenizer.from_pretrained(oss_dir)
    text, ids = chat_prompt(tok, [ChatMessage.model_validate(m) for m in MESSAGES], True, [WEATHER])
    assert text.endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    assert "# Instructions\n\nBe brief." in text and "type get_weather = (_: {" in text
    assert ids.count(tok.convert_tokens_to_ids("<|start|>")) == 4  # system, developer, user, the reply


@pytest.mark.parametrize("text, want", [
    ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Four.<|return|>",
     ("hmm", "Four.", [])),
    ("<|channel|>final<|message|>Four.", ("", "Four.", [])),  # cut short: what is there
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.f "
     '<|constrain|>json<|message|>{"a": 1}<|call|>', ("x", "", [("f", '{"a": 1}')])),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\"", ("", "", [])),  # unfinished call
    ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.g<|channel|>commentary"
     "<|message|>{}<|call|>", ("", "Let me look.", [("g", "{}")])),  # a preamble; the recipient before the channel
])
def test_split_and_its_stream_agree(text, want):
    got = parts(messages(text))
    assert (got.reasoning, got.content, [(c.name, c.arguments) for c in got.calls]) == want
    for step in (1, 3, 7):
        stream = HarmonyStream()
        thought = content = ""
        calls = []
        for i in range(step, len(text) + step, step):
            t, c, new = stream.feed(text[:i], i >= len(text))
            thought, content, calls = thought + t, content + c, calls + new
        assert (thought, content, [(c.name, c.arguments) for c in calls]) == want


def test_when_harmony_parsing_is_on():
    template = "<|start|>assistant<|channel|>final<|message|>"
    assert harmony.enabled(None, "auto", template) and not harmony.enabled(None, "auto", "<|im_start|>")
    assert harmony.enabled("openai_gptoss", "hermes", None) and harmony.enabled(None, "openai", None)
    assert not harmony.enabled("qwen3", "auto", template)  # another parser asked for


def test_reasoning_effort_reaches_the_reasoning_line(oss_dir, oss_server, client):
    """OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses) set the harmony system
    message's Reasoning line, as gpt-oss's template reads it: the prompt the engine ran (its
    prompt logprobs' tokens) is the template's with that effort."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(oss_dir)

    def ran(**extra) -> str:
        body = client.chat.completions.create(model="oss", messages=MESSAGES, max_tokens=1, temperature=0,
                                              extra_body={"prompt_logprobs": 0}, **extra).model_extra
        ids = [int(next(iter(d))) for d in body["prompt_logprobs"][1:]]
        return tok.decode(ids)

    for effort in ("low", "high"):
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, reasoning_effort=effort, tokenize=False)
        assert f"Reasoning: {effort}" in text
        assert ran(reasoning_effort=effort) == tok.decode(tok.encode(text, add_special_tokens=False)[1:])
    r = client.responses.create(model="oss", input=MESSAGES[1]["content"], instructions=MESSAGES[0]["content"],
                                max_output_tokens=1, temperature=0, reasoning={"effort": "low"})
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, reasoning_effort="low", tokenize=False)
    assert r.reasoning.effort == "low"  # its prompt is the template's with "low" (two tokens fewer than "medium")
    assert r.usage.input_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("seed", range(20))
def test_the_stream_reads_each_finished_message_once_and_agrees_with_the_whole_split(seed):
    """Random harmony outputs, fed in random pieces: after every piece the deltas so far are the
    split of the text so far (less a marker's possible start), as a fresh read of it would say."""
    import random

    from expresslane.server.harmony import held

    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("ab<|>e nd") for _ in range(rng.randrange(0, 6)))  # noqa: E731
    pieces = []
    for _ in range(rng.randrange(1, 6)):
        kind = rng.choice(["analysis", "final", "commentary", "call"])
        head = ("commentary to=functions.f <|constrain|>json" if kind == "call" else kind)
        end = "<|call|>" if kind == "call" else rng.choice(["<|end|>", "<|return|>"])
        pieces.append(f"<|channel|>{head}<|message|>{word()} {word()}{end}<|start|>assistant")
    text = "".join(pieces)[:rng.randrange(1, len("".join(pieces)) + 1)]
    stream = HarmonyStream()
    thought = content = ""
    calls = []
    i = 0
    while i < len(text):
        i = min(len(text), i + rng.randrange(1, 12))
        done = i == len(text)
        t, c, new = stream.feed(text[:i], done)
        thought, content, calls = thought + t, content + c, calls + new
        want = parts(messages(text[:i] if done else text[:i - held(text[:i])]))
        assert (thought, content, [(x.name, x.arguments) for x in calls]) == \
            (want.reasoning, want.content, [(x.name, x.arguments) for x in want.calls])


def test_a_grammar_holds_the_answer_s_message_not_the_thinking(oss_dir):
    """By default a grammar waits for the final channel's header, so the model thinks freely
    first (vLLM's gpt-oss reasoning parser); a continued final message is inside it already: the
    JSON is the content."""
    from transformers import AutoTokenizer

    from expresslane import SamplingParams
    from expresslane.sampling_params import StructuredOutputs
    from expresslane.server.reasoning import grammar_after_thinking

    tok = AutoTokenizer.from_pretrained(oss_dir)
    params = SamplingParams(structured_outputs=StructuredOutputs(json_object=True))
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    waits = grammar_after_thinking(params, prompt, tok, "openai_gptoss").structured_outputs.after_token_ids
    assert tok.decode(waits) == "<|channel|>final<|message|>"
    s = Server(str(oss_dir), "--served-model-name", "oss", "--max-model-len", "1024").wait_ready()
    try:
        client = OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
        answer = client.chat.completions.create(
            model="oss", messages=[*MESSAGES, {"role": "assistant", "content": ""}], max_tokens=40, temperature=0,
            response_format={"type": "json_object"},
            extra_body={"continue_final_message": True, "add_generation_prompt": False}).choices[0].message
        assert isinstance(json.loads(answer.content), dict) and not answer.model_extra.get("reasoning_content")
    finally:
        s.stop()
