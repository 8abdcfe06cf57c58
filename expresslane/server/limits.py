"""Per-request limits: no request, however large, stalls the event loop or swamps the server.

Each is a ``serve`` flag; a request over one gets a 413 (body) or 400 that names the
limit and the flag. They are checked in order of cost: the body's size while it is
read, then, once parsed, the counts (stop strings, sequences, logprobs) and each
prompt's characters, all before any tokenization. ``max_prompt_chars`` defaults to
what the context could ever hold (``max_model_len`` × the longest token's characters),
so a prompt over it is refused without tokenizing it.
"""

from __future__ import annotations

from starlette.requests import Request

from expresslane.config.server import RequestLimits
from expresslane.server import errors


def _over(message: str, param: str | None, status: int = 400, code: str = "request_too_large") -> errors.APIError:
    return errors.APIError(status, message, "invalid_request_error", param, code)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to be over ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_big = f"the request body is over {limit} bytes (--max-request-body-bytes)"
    if declared.isdigit() and int(declared) > limit:
        raise _over(too_big, None, 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _over(too_big, None, 413)
        chunks.append(chunk)
    return b"".join(chunks)


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token decodes to: its vocabulary entry's length
    (byte-level BPE writes one character per byte; SentencePiece one per character)."""
    return max(len(t) for t in tokenizer.get_vocab())


def check_counts(limits: RequestLimits, *, stop: list[str] | str | None, n: int, num_prompts: int,
                 logprobs: int | None, logprobs_param: str) -> None:
    if isinstance(stop, list) and len(stop) > limits.max_stop_strings:
        raise _over(f"{len(stop)} stop strings is more than this server takes ({limits.max_stop_strings}, "
                    "--max-stop-strings)", "stop")
    if n * num_prompts > limits.max_sequences_per_request:
        raise _over(f"this request asks for {num_prompts} prompts × n={n} = {n * num_prompts} completions, more "
                    f"than this server takes ({limits.max_sequences_per_request}, --max-sequences-per-request)", "n")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise _over(f"'{logprobs_param}' {logprobs} is more than this server returns ({limits.max_logprobs}, "
                    "--max-logprobs)", logprobs_param, code="invalid_value")


def check_chars(text_lengths: list[int], max_chars: int, max_model_len: int, param: str) -> None:
    """Prompts that cannot fit the context whatever their tokens (or over --max-prompt-chars)."""
    for n in text_lengths:
        if n > max_chars:
            raise errors.context_too_long(
                f"the prompt has {n} characters, more than this server takes ({max_chars}, --max-prompt-chars; "
                f"by default what this model's maximum context length of {max_model_len} tokens could hold)", param)


def check_tokens(n: int, max_model_len: int) -> None:
    """/detokenize: no sequence of this model is longer than its context (and decoding millions
    of ids holds the GIL for seconds)."""
    if n > max_model_len:
        raise errors.context_too_long(f"{n} token ids is more than this model's maximum context length of "
                                      f"{max_model_len} tokens", "tokens")


def precheck(obj: object, limits: RequestLimits, max_chars: int, max_model_len: int, vocab_size: int) -> None:
    """The limits, checked on a large decoded body before its validation (pydantic builds a model
    per message and checks every item: about 1 s for a million messages). Anything malformed is
    left to the validation. Counts no request can need are refused here too: more messages and
    content parts than the context has tokens (each takes at least one), more stop token ids
    than the vocabulary has."""
    if not isinstance(obj, dict):
        return
    n = obj.get("n") if isinstance(obj.get("n"), int) else 1
    prompt = obj.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    logprobs = obj.get("top_logprobs", obj.get("logprobs"))
    check_counts(limits, stop=obj.get("stop"), n=n, num_prompts=len(prompts),
                 logprobs=logprobs if isinstance(logprobs, int) and not isinstance(logprobs, bool) else None,
                 logprobs_param="top_logprobs" if "top_logprobs" in obj else "logprobs")
    check_chars([len(p) for p in prompts if isinstance(p, str)], max_chars, max_model_len, "prompt")
    for p in prompts:
        if isinstance(p, list) and len(p) >= max_model_len:
            raise errors.context_too_long(f"the prompt has {len(p)} tokens; this model's maximum context length is "
                                          f"{max_model_len} tokens", "prompt")
    if isinstance(obj.get("tokens"), list):  # /detokenize
        check_tokens(len(obj["tokens"]), max_model_len)
    stop_ids = obj.get("stop_token_ids")
    if isinstance(stop_ids, list) and len(stop_ids) > vocab_size:
        raise _over(f"{len(stop_ids)} stop token ids is more than the vocabulary has tokens ({vocab_size})",
                    "stop_token_ids")
    if isinstance(obj.get("input"), str):  # the Responses API's input as one message
        check_chars([len(obj["input"])], max_chars, max_model_len, "input")
    for field in ("messages", "input"):  # chat's messages; the Responses API's input items
        _precheck_messages(obj.get(field), field, max_chars, max_model_len)


def _precheck_messages(messages: object, field: str, max_chars: int, max_model_len: int) -> None:
    if isinstance(messages, list):
        chars, items = 0, len(messages)
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                items += len(content)
                chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
            if items > max_model_len:
                raise errors.context_too_long(f"the conversation has more messages and content parts than this "
                                              f"model's maximum context length of {max_model_len} tokens could hold "
                                              "(each takes at least one)", field)
        check_chars([chars], max_chars, max_model_len, field)
