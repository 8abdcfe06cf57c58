"""Fresh prompts of exact token lengths, for any server.

Prompt text is random common English words (nothing to download), drawn anew for every
request, so no measured prompt shares a cached prefix with another (a 16-token block
would need its first words to repeat) unless a dataset shares one on purpose.

Lengths are made exact by the model's own tokenizer, as ``vllm bench serve`` aligns its
random prompts: the server's ``/tokenize`` and ``/detokenize`` (expresslane and vLLM
have both), or a local one (``--tokenizer DIR``). A draw of somewhat more words is
tokenized, cut to the target, decoded, and the cut text tokenized again the way the
server will count it (special tokens included); the count that comes back is the
prompt's length. Without a tokenizer, lengths are estimates (one word = one token),
and the run says so.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
import numpy as np

from expresslane.bench.client import Endpoint, error_message
from expresslane.bench.records import RequestRecord

WORDS = np.array("""
time people year way day man thing woman life child world school state family
student group country problem hand part place case week company system program
question work government number night point home water room mother area money
story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city name
team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl
guy moment air teacher force education light river green small large open""".split())
PARALLEL = 16  # tokenizer calls in flight at once


def word_text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(WORDS[rng.integers(0, len(WORDS), max(1, n_words))])


class TokenizerUnavailable(Exception):
    pass


class ServerTokenizer:
    """The server's ``/tokenize`` and ``/detokenize`` (vLLM's request and response keys)."""

    def __init__(self, session: aiohttp.ClientSession, ep: Endpoint):
        self.session, self.ep = session, ep
        self.name = "exact (the server's /tokenize)"
        self.limit = asyncio.Semaphore(PARALLEL)

    async def call(self, path: str, body: dict) -> dict:
        async with self.limit:
            try:
                async with self.session.post(self.ep.base_url + path, headers=self.ep.headers,
                                             json={"model": self.ep.model, **body}) as resp:
                    if resp.status != 200:
                        raise TokenizerUnavailable(f"{path}: HTTP {resp.status}: "
                                                   f"{error_message(await resp.text())}")
                    return await resp.json()
            except (aiohttp.ClientError, ValueError) as e:
                raise TokenizerUnavailable(f"{path}: {type(e).__name__}: {e}") from None

    async def encode(self, text: str, special: bool) -> list[int]:
        data = await self.call("/tokenize", {"prompt": text, "add_special_tokens": special})
        if not isinstance(data.get("tokens"), list):
            raise TokenizerUnavailable("/tokenize answered without a 'tokens' list")
        return data["tokens"]

    async def decode(self, ids: list[int]) -> str:
        data = await self.call("/detokenize", {"tokens": ids})
        if not isinstance(data.get("prompt"), str):
            raise TokenizerUnavailable("/detokenize answered without a 'prompt' string")
        return data["prompt"]

    async def chat_overhead(self) -> int:
        """Tokens a chat request has beyond its message sent as a plain prompt (0 if unknown)."""
        try:
            data = await self.call("/tokenize", {"messages": [{"role": "user", "content": "x"}]})
            return max(0, len(data["tokens"]) - len(await self.encode("x", True)))
        except (TokenizerUnavailable, KeyError, TypeError):
            return 0


class LocalTokenizer:
    """A Hugging Face tokenizer on this machine (``--tokenizer``)."""

    def __init__(self, path: str):
        from expresslane.tokenizer import load_tokenizer

        self.tok = load_tokenizer(path)
        self.name = f"exact (tokenizer {path})"

    async def encode(self, text: str, special: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special)

    async def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    async def chat_overhead(self) -> int:
        if not getattr(self.tok, "chat_template", None):
            return 0
        ids = self.tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True,
                                           add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        return max(0, len(ids) - len(self.tok.encode("x", add_special_tokens=True)))


class PromptMaker:
    """Draws word prompts and makes their lengths exact with ``tokenizer`` (None: estimates)."""

    def __init__(self, tokenizer: ServerTokenizer | LocalTokenizer | None):
        self.tokenizer = tokenizer
        self.source = tokenizer.name if tokenizer else "estimate (one word = one token)"
        self.specials = 0  # special tokens the server adds to a prompt (BOS)
        self.tokens_per_word = 1.0

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    async def calibrate(self) -> None:
        if self.tokenizer is None:
            return
        sample = word_text(np.random.default_rng(0), 256)
        with_special = await self.tokenizer.encode(sample, True)
        plain = await self.tokenizer.encode(sample, False)
        self.specials = len(with_special) - len(plain)
        self.tokens_per_word = max(len(plain) / 256, 0.05)

    async def prompt(self, rng: np.random.Generator, target: int, prefix: str = "") -> tuple[str, int]:
        """A fresh prompt of ``target`` tokens as the server counts them (after ``prefix``
        text, if given), and its exact length (the estimate without a tokenizer)."""
        if self.tokenizer is None:
            words = target - round(len(prefix.split()) * self.tokens_per_word)
            return (prefix + " " if prefix else "") + word_text(rng, words), target
        target = max(target, self.specials + 1)
        keep = target - self.specials
        n_words = math.ceil(keep / self.tokens_per_word * 1.2) + 4
        while True:
            text = (prefix + " " if prefix else "") + word_text(rng, n_words)
            ids = await self.tokenizer.encode(text, False)
            if len(ids) >= keep:
                break
            n_words *= 2
        n = 0
        for _ in range(4):  # a cut can merge or split a token at the seam: correct by the miss
            text = await self.tokenizer.decode(ids[:keep])
            n = len(await self.tokenizer.encode(text, True))
            if n == target or not 0 < keep + target - n <= len(ids):
                break
            keep += target - n
        return text, n

    async def count(self, text: str) -> int:
        """Tokens of ``text`` as the server counts a prompt (estimate without a tokenizer)."""
        if self.tokenizer is None:
            return max(1, len(text.split()))
        return len(await self.tokenizer.encode(text, True))

    async def recount_outputs(self, records: list[RequestRecord]) -> None:
        """Output lengths the stream could only count in chunks: counted by the tokenizer."""
        if self.tokenizer is None:
            return
        todo = [r for r in records if r.success and r.output_count == "chunks" and r.text]
        counts = await asyncio.gather(*(self.tokenizer.encode(r.text, False) for r in todo),
                                      return_exceptions=True)
        for r, ids in zip(todo, counts):
            if isinstance(ids, list) and ids:
                r.output_len, r.output_count = len(ids), "tokenizer"


async def make_prompt_maker(session: aiohttp.ClientSession, ep: Endpoint,
                            local: str | None) -> tuple[PromptMaker, list[str]]:
    """The best tokenizer there is, calibrated, and a notice when lengths are estimates."""
    tokenizer: ServerTokenizer | LocalTokenizer | None
    notices = []
    if local:
        tokenizer = LocalTokenizer(local)
    else:
        tokenizer = ServerTokenizer(session, ep)
    maker = PromptMaker(tokenizer)
    try:
        await maker.calibrate()
    except TokenizerUnavailable as e:
        maker = PromptMaker(None)
        notices.append(f"prompt lengths are estimates (one word = one token): the server has no "
                       f"working /tokenize ({e}) and no --tokenizer was given; the server's usage "
                       "report gives the exact counts afterwards")
    return maker, notices
