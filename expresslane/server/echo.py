"""The prompt in a response: /v1/completions' ``echo`` (the prompt's text and, with
``logprobs``, its logprobs before the completion's) and vLLM's ``prompt_logprobs`` field.

The engine scores the prompt once, with the larger of the two top-k's (``SamplingParams.
prompt_logprobs``); each field is cut to its own here. ``max_tokens: 0`` with ``echo`` runs the
engine for one token, which never leaves this module: not in the text, the logprobs or the usage.
"""

from __future__ import annotations

from dataclasses import dataclass

from expresslane.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class Echo:
    echo: bool = False  # the prompt's text (and logprobs) before the completion's
    only: bool = False  # max_tokens 0: the prompt alone
    logprobs: int | None = None  # `logprobs`: the echoed prompt's top-k too
    prompt_logprobs: int | None = None  # vLLM's field: its top-k (None: no field)

    @classmethod
    def of(cls, req) -> Echo:
        """From a CompletionRequest."""
        return cls(req.echo, req.echo_only, req.logprobs, req.prompt_logprobs)


def prompt_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as sent, or its token ids decoded (a prompt of ids has no text)."""
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def _top(entry: dict, k: int) -> list[tuple[int, object]]:
    """A position's prompt token (first in the engine's dict) and its top k."""
    return [(t, lp) for i, (t, lp) in enumerate(entry.items()) if i == 0 or lp.rank <= k]


def prompt_logprobs_field(out: RequestOutput, k: int) -> list | None:
    """vLLM's ``prompt_logprobs``: null for the first token, then per position token id ->
    {logprob, rank, decoded_token}, the prompt token's and the top k."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in _top(e, k)} for e in out.prompt_logprobs]


def echoed_logprobs(out: RequestOutput, k: int, texts) -> dict:
    """The prompt's part of a completion's ``logprobs``: its first token has none (null)."""
    ids = out.prompt_token_ids
    tokens = [texts[t] for t in ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    entries = out.prompt_logprobs or [None]
    return {"tokens": tokens,
            "token_logprobs": [None] + [e[t].logprob for t, e in zip(ids[1:], entries[1:])],
            "top_logprobs": [None] + [{texts[t]: lp.logprob for t, lp in _top(e, k)} for e in entries[1:]],
            "text_offset": offsets}


def join(prompt: dict, completion: dict) -> dict:
    """The prompt's logprobs, then the completion's: offsets count on over the tokens' texts, as vLLM's."""
    shift = prompt["text_offset"][-1] + len(prompt["tokens"][-1])
    return {"tokens": prompt["tokens"] + completion["tokens"],
            "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
            "text_offset": prompt["text_offset"] + [shift + o for o in completion["text_offset"]]}
