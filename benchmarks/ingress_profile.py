"""Where a prompt's tokens cost time between the HTTP request and the engine (issue #20 item 4).

Part 1, stage by stage (in-process, the real objects, min of --repeats runs): each stage
the server and the engine run once per request, timed at prompt lengths 128, 2048 and
8192, reported in us and in us per prompt token (the slope between the two longest):

  json+validate   protocol.parse of the body (text, or token ids): msgspec decode + pydantic
  tokenize        transformers' encode of the prompt text, and InputProcessor's (the Rust
                  tokenizer directly: the same ids)
  id checks       InputProcessor.tokenize of a token-id prompt + InputProcessor.check
  outputs.add     OutputProcessor.add_request (detokenizer set-up)
  wire            msgspec encode of Add([EngineCoreRequest]) and the engine's decode
  core.add        EngineCore.add_request's work: length check, Request.from_core_request
  block hashes    the prefix cache's chained block hashes of the whole prompt
  schedule        the prompt's first plans (budget 2048 tokens: 4 steps at 8192)
  runner inputs   RequestRows.apply of those plans (numpy step inputs)

Part 2, end to end (--serve): a real `expresslane serve` on a copy of the tiny model with a
16k context; a 1-token request per length with return_metrics: client time, the engine's
own TTFT (first token - engine arrival) and the difference (the server's part).

    python benchmarks/ingress_profile.py [--serve] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
from _shared import emit

from expresslane.bench.prompts import word_text
from expresslane.config import EngineConfig
from expresslane.contract import EngineCoreRequest, NewRequest
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.engine.llm_engine import InputProcessor
from expresslane.engine.output_processor import OutputProcessor
from expresslane.scheduler.request import Request, check_prompt_length
from expresslane.scheduler.scheduler import Scheduler
from expresslane.models.presets import default_model_dir
from expresslane.runner.request_rows import RequestRows
from expresslane.sampling_params import SamplingParams
from expresslane.server.protocol import CompletionRequest, parse
from expresslane.server.wire import Add, ToEngine
from expresslane.tokenizer import load_tokenizer

LENGTHS = (128, 2048, 8192)
CONTEXT = 16384


def best_us(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def text_of(tokenizer, n: int, rng: np.random.Generator) -> tuple[str, list[int]]:
    """A text of exactly n tokens: the bench's random English words, cut to n tokens."""
    ids = tokenizer.encode(word_text(rng, n), add_special_tokens=False)[:n]
    return tokenizer.decode(ids), ids


def stages(n: int, tokenizer, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(n)
    text, ids = text_of(tokenizer, n, rng)
    params = SamplingParams(max_tokens=1)
    inputs = InputProcessor(tokenizer, tokenizer.vocab_size, CONTEXT, (0,))
    body_text = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1}).encode()
    body_ids = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1}).encode()
    core_req = EngineCoreRequest("r", ids, params, (0,), 0.0)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(ToEngine).decode
    wire = encode(Add([core_req]))
    out: dict[str, float] = {
        "json+validate (text)": best_us(lambda: parse(CompletionRequest, body_text), repeats),
        "json+validate (ids)": best_us(lambda: parse(CompletionRequest, body_ids), repeats),
        "tokenize (transformers)": best_us(lambda: tokenizer.encode(text), repeats),
        "tokenize (InputProcessor)": best_us(lambda: inputs.tokenize(text), repeats),
        "id checks": best_us(lambda: (inputs.tokenize({"prompt_token_ids": ids}), inputs.check(ids, params)),
                             repeats),
    }
    counter = iter(range(1 << 30))
    procs = OutputProcessor(tokenizer)
    out["outputs.add"] = best_us(lambda: procs.add_request(f"r{next(counter)}", text, ids, params, 0.0), repeats)
    out["wire encode"] = best_us(lambda: encode(Add([core_req])), repeats)
    out["wire decode"] = best_us(lambda: decode(wire), repeats)
    out["core.add"] = best_us(lambda: (check_prompt_length(len(ids), CONTEXT),
                                       Request.from_core_request(core_req, CONTEXT)), repeats)

    def hashes():
        kv = KVCacheManager(CONTEXT // 16 + 1, 16)
        kv._block_hashes(Request.from_core_request(core_req, CONTEXT))
    out["block hashes"] = best_us(hashes, repeats)

    def plans():
        config = EngineConfig.from_kwargs(max_num_batched_tokens=2048, max_num_seqs=8)
        sched = Scheduler(config.scheduler, KVCacheManager(CONTEXT // 16 + 1, 16))
        sched.add_request(Request.from_core_request(EngineCoreRequest("r", ids, params, (0,), 0.0), CONTEXT))
        result = []
        while not result or result[-1].seqs[0].start_pos + len(result[-1].seqs[0].token_ids) < n:
            result.append(sched.schedule())
        return result
    out["schedule"] = best_us(plans, repeats)
    steps = plans()

    def runner_inputs():
        rows = RequestRows(8, CONTEXT // 16 + 1, 16)
        for plan in steps:
            plan.new_requests = plan.new_requests or []
            rows.apply(plan)
    steps[0].new_requests = steps[0].new_requests or [NewRequest("r", params)]
    out["runner inputs"] = best_us(runner_inputs, repeats)
    return out


def long_context_model(tmp: Path) -> Path:
    """The tiny model with a 16k context (random weights; RoPE takes any position)."""
    src = default_model_dir()
    dst = tmp / "tiny-16k"
    shutil.copytree(src, dst)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        path = dst / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg[key] = CONTEXT
            path.write_text(json.dumps(cfg))
    return dst


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def end_to_end(tokenizer, repeats: int) -> dict[int, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        model = long_context_model(Path(tmp))
        port = 18000 + int(time.time()) % 1000
        proc = subprocess.Popen([sys.executable, "-m", "expresslane.cli.main", "serve", str(model), "--port",
                                 str(port), "--max-num-seqs", "4", "--num-kv-blocks", str(CONTEXT // 16 + 64)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                name = json.loads(resp.read())["data"][0]["id"]
            rows = {}
            rng = np.random.default_rng(1)
            for n in LENGTHS:
                client_ms, engine_ms = [], []
                for _ in range(repeats + 1):  # the first is a warm-up
                    text, _ = text_of(tokenizer, n, rng)
                    t0 = time.perf_counter()
                    r = post(url + "/v1/completions", {"model": name, "prompt": text, "max_tokens": 1,
                                                        "return_metrics": True})
                    client_ms.append((time.perf_counter() - t0) * 1e3)
                    m = r["metrics"]
                    engine_ms.append((m["first_token_time"] - m["engine_arrival_time"]) * 1e3)
                c, e = min(client_ms[1:]), min(engine_ms[1:])
                rows[n] = {"client_ms": c, "engine_ttft_ms": e, "server_ms": c - e}
            return rows
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--serve", action="store_true", help="also measure end to end through a real server")
    p.add_argument("--out")
    args = p.parse_args()
    tokenizer = load_tokenizer(default_model_dir())
    table = {n: stages(n, tokenizer, args.repeats) for n in LENGTHS}
    a, b = LENGTHS[-2], LENGTHS[-1]
    print(f"{'stage':24}" + "".join(f"{n:>10} tok" for n in LENGTHS) + f"{'us/token':>12}")
    for stage in table[LENGTHS[0]]:
        slope = (table[b][stage] - table[a][stage]) / (b - a)
        print(f"{stage:24}" + "".join(f"{table[n][stage]:>11.0f}us" for n in LENGTHS) + f"{slope:>12.3f}")
        emit(args.out, bench="ingress_stage", stage=stage, us={str(n): table[n][stage] for n in LENGTHS},
             us_per_token=slope)
    if args.serve:
        rows = end_to_end(tokenizer, args.repeats)
        print(f"\n{'end to end':24}{'client ms':>12}{'engine TTFT':>14}{'server ms':>12}")
        for n, r in rows.items():
            print(f"{n:>8} tokens{'':12}{r['client_ms']:>12.2f}{r['engine_ttft_ms']:>14.2f}{r['server_ms']:>12.2f}")
        slope = (rows[b]["server_ms"] - rows[a]["server_ms"]) / (b - a) * 1e3
        print(f"server time per prompt token: {slope:.2f} us")
        emit(args.out, bench="ingress_end_to_end", rows={str(n): r for n, r in rows.items()},
             server_us_per_token=slope)


if __name__ == "__main__":
    main()
