"""The API process's RSS as its tokenizer meets new words (issue #44's soak; a measurement, not a test).

Starts `expresslane serve` (built-in tiny model) and sends only `/tokenize` (no engine work), 8
clients at a time: a warm-up, then batches with one fixed prompt, then batches with a new number
in each prompt (as the soak's prompts carry). Prints the API process's RSS after each batch. The
tokenizer's word cache (`expresslane/tokenizer.py`, WORD_CACHE_WORDS) holds the tokens of the
words it has seen: the new-number batches grow the process until the cache is full.

    python benchmarks/word_cache_rss.py
    python benchmarks/word_cache_rss.py --batches 8 --batch 4000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import httpx
from _shared import emit, rss_mb, start_server, stop_server

CLIENTS = 8


async def send(url: str, n: int, rng: random.Random | None) -> None:
    """n /tokenize requests: the prompt 'tok 0.5', or with rng a new number in each."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def client() -> None:
            for _ in range(n // CLIENTS):
                prompt = f"tok {rng.random()}" if rng else "tok 0.5"
                r = await http.post("/tokenize", json={"prompt": prompt})
                r.raise_for_status()

        await asyncio.gather(*(client() for _ in range(CLIENTS)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4000, help="requests a batch")
    p.add_argument("--batches", type=int, default=6, help="batches with new numbers")
    p.add_argument("--out", default=None, help="append the JSON line to this file")
    args = p.parse_args()
    log = tempfile.NamedTemporaryFile(prefix="word-cache-rss-", suffix=".log", delete=False).name
    proc, url = start_server([], log)
    try:
        series = []

        def batch(label: str, n: int, rng: random.Random | None) -> None:
            asyncio.run(send(url, n, rng))
            time.sleep(1.0)
            series.append((label, round(rss_mb(proc.pid), 1)))

        batch("warm", 2000, None)
        for k in (1, 2):
            batch(f"fixed x{k * args.batch}", args.batch, None)
        rng = random.Random(0)
        for k in range(1, args.batches + 1):
            batch(f"new numbers x{k * args.batch}", args.batch, rng)
        emit(args.out, benchmark="word_cache_rss", rss_mb=series,
             growth_mb=round(series[-1][1] - series[2][1], 1))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
