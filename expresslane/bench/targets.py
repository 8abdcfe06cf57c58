"""Where the flat-latency experiment sends its prompts: an in-process ``LLM``,
transformers' ``generate`` (the baseline), or any OpenAI-compatible server.

A target takes prompt lengths, submits prompts of those lengths *together, in list
order*, and returns one ``RequestRecord`` each. Targets built with the same seed
draw the same prompts in the same order, so every row of the experiment sees the
same prompts; each draw is fresh, so no prompt hits a prefix cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import numpy as np
import torch

from expresslane import LLM, SamplingParams
from expresslane.bench import client
from expresslane.bench.inprocess import (device_and_dtype, random_prompts, record_from_output, release_memory,
                                         synchronize)
from expresslane.bench.records import RequestRecord


class EngineTarget:
    """One ``LLM`` with one batching mode; all prompts are queued before the first step."""

    def __init__(self, model: str | None, engine_args: dict, seed: int):
        self.llm = LLM(model, **engine_args)
        core = self.llm.engine.core
        self.model_dir, self.max_model_len = core.model_dir, core.max_model_len
        self.device, self.dtype = device_and_dtype(self.llm)
        self.vocab_size = core.hf_config.vocab_size
        self.rng = random.Random(seed)

    def submit(self, lengths: list[int], output_len: int, lanes: list[str] | None = None) -> list[RequestRecord]:
        prompts = [{"prompt_token_ids": ids}
                   for ids in random_prompts(self.rng, self.vocab_size, lengths)]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params, lane=lanes, use_tqdm=False)
        return [record_from_output(o) for o in outs]

    def close(self) -> None:
        del self.llm
        release_memory()


class HFTarget:
    """transformers ``generate`` on one static batch, left-padded to its longest prompt.

    TTFT is the time of ``generate(max_new_tokens=1)``: every member gets its first
    token when the whole padded batch has been prefilled.
    """

    def __init__(self, model_dir, device: torch.device, dtype: torch.dtype, seed: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.rng = random.Random(seed)

    @torch.inference_mode()
    def submit(self, lengths: list[int], output_len: int, lanes: list[str] | None = None) -> list[RequestRecord]:
        """`lanes` is ignored: transformers has no lanes."""
        prompts = random_prompts(self.rng, self.model.config.vocab_size, lengths)
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding: each row ends with its last prompt token
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        synchronize(self.device)
        t0 = time.perf_counter()
        self.model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                            pad_token_id=0)
        synchronize(self.device)
        ttft = time.perf_counter() - t0
        return [RequestRecord(input_len=len(p), start=t0, end=t0 + ttft, success=True, output_len=1,
                              ttft=ttft, latency=ttft) for p in prompts]

    def close(self) -> None:
        del self.model
        release_memory()


class HttpTarget:
    """Streaming requests to an OpenAI-compatible server, through the bench client.

    Prompts are fresh word prompts of exact lengths (the server's ``/tokenize``, or
    ``--tokenizer``); ``max_model_len`` is what the server reports in ``/v1/models``.
    """

    # The first request of a submission leaves this much earlier, so that it is first in
    # the server's queue ("long first") even though the requests travel on separate connections.
    LEAD_S = 0.01

    def __init__(self, opts: client.ClientOptions, seed: int):
        from expresslane.bench.serving import connect

        self.loop = asyncio.new_event_loop()
        self.session = None
        try:
            self.session = self.loop.run_until_complete(self._session())
            self.endpoint, self.maker, self.notices = self.loop.run_until_complete(
                connect(self.session, replace(opts, ignore_eos=True)))
        except BaseException:
            self.close()
            raise
        # ignore_eos: a first token that is EOS would carry no text, so no TTFT.
        self.max_model_len = self.endpoint.max_model_len
        self.rng = np.random.default_rng(seed)

    @staticmethod
    async def _session():
        return client.make_session()

    def submit(self, lengths: list[int], output_len: int, lanes: list[str] | None = None) -> list[RequestRecord]:
        return self.loop.run_until_complete(self._submit(lengths, output_len, lanes or [None] * len(lengths)))

    async def _submit(self, lengths: list[int], output_len: int, lanes: list[str | None]) -> list[RequestRecord]:
        prompts = [await self.maker.prompt(self.rng, n) for n in lengths]  # before the clock starts
        send = [client.send_request(self.session, self.endpoint, text, n, output_len, lane=lane)
                for (text, n), lane in zip(prompts, lanes)]
        first = asyncio.create_task(send[0])
        if len(send) > 1:
            await asyncio.sleep(self.LEAD_S)
        rest = await asyncio.gather(*send[1:])
        return [await first, *rest]

    def close(self) -> None:
        if self.session is not None:
            self.loop.run_until_complete(self.session.close())
        self.loop.close()
