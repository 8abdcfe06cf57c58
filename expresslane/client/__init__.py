"""A small async client for expresslane that backs off (``Retry-After``, jittered exponential
backoff; a stream that delivered tokens is never retried), with per-lane timeouts, and
client-side merging of small non-interactive completions. Needs ``httpx``
(``pip install expresslane[client]``); ``import expresslane`` does not import it.

    from expresslane.client import Client, CompletionMerger
    async with Client("http://127.0.0.1:8000", api_key="...") as c:
        r = await c.completions(model="tiny", prompt="Hello", max_tokens=16)
        merger = CompletionMerger(c, window=0.02)
        answers = await asyncio.gather(*(merger.complete(p, model="tiny", max_tokens=8) for p in prompts))
"""

from expresslane.client.client import APIStatusError, Client, StreamInterrupted
from expresslane.client.merging import CompletionMerger
from expresslane.backoff import Backoff, parse_retry_after

__all__ = ["APIStatusError", "Backoff", "Client", "CompletionMerger", "StreamInterrupted", "parse_retry_after"]
