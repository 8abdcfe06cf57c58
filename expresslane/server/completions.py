"""/v1/completions' responses: a choice's text and logprobs, with ``echo`` and ``prompt_logprobs``
(server/echo.py) when asked."""

from __future__ import annotations

from expresslane.outputs import RequestOutput
from expresslane.server.echo import Echo, echoed_logprobs, join, prompt_logprobs_field, prompt_text
from expresslane.server.serving import Delta, _encoded, _Endpoint, usage
from expresslane.server.tracker import TopLogprobs


class Completions(_Endpoint):
    chunk_object = "text_completion"

    def __init__(self, *args, echo: Echo = Echo(), **kwargs):
        super().__init__(*args, **kwargs)
        self.echo = echo  # echo, max_tokens 0, prompt_logprobs (server/echo.py)

    def chunk(self, d: Delta) -> dict:
        return self.envelope(self.chunk_object, [self.choice(d.index, d.output, d.text, d.token_ids, d.logprobs,
                                                             d.finish_reason, d.stop_reason)])

    def response(self, finals: list[RequestOutput]) -> dict:
        return self.envelope("text_completion", [
            _encoded(self.choice(self.choice_index(i, c), o, c.text, c.token_ids, c.logprobs, c.finish_reason,
                                 c.stop_reason))
            for i, o in enumerate(finals) for c in o.outputs])

    def choice(self, index: int, prompt: RequestOutput | None, text: str, token_ids: list[int],
               lps: list[TopLogprobs] | None, finish: str | None, stop_reason: int | str | None) -> dict:
        """A choice, or a chunk's; `prompt` (its first, with echo) puts the prompt before the text."""
        if self.echo.only:  # the engine's one token is not the client's
            text, token_ids, lps = "", [], None if lps is None else []
            finish, stop_reason = ("length" if finish else None), None
        choice = {"index": index, "text": text, "logprobs": self.logprobs(token_ids, lps), "finish_reason": finish,
                  "stop_reason": stop_reason}
        if prompt is not None and self.echo.echo:
            echoed = prompt_text(prompt, self.client.tokenizer)
            choice["text"] = echoed + text
            if choice["logprobs"] is not None:
                choice["logprobs"] = join(echoed_logprobs(prompt, self.echo.logprobs, self.client.token_texts),
                                          choice["logprobs"])
        if prompt is not None and self.echo.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(prompt, self.echo.prompt_logprobs)
        return choice

    def count_usage(self, finals: list[RequestOutput]) -> dict:
        u = usage(finals)
        if self.echo.only:
            u.update(completion_tokens=0, total_tokens=u["prompt_tokens"])
        return u

    def logprobs(self, token_ids: list[int], lps: list[TopLogprobs] | None) -> dict | None:
        if lps is None:
            return None
        texts = self.client.token_texts
        tokens = [texts[t] for t in token_ids]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in zip(token_ids, lps)],
                "top_logprobs": [{texts[k]: v for k, v in lp.items()} for lp in lps], "text_offset": offsets}
