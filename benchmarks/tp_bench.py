"""Tensor parallelism on one host's GPUs (issue #12; figures for issue #13):

1. small all-reduces, the size of one decode step's o_proj/down_proj outputs (tokens x
   hidden, bf16): NCCL's all_reduce against torch.distributed._symmetric_memory's one-shot
   all-reduce (each rank reads the others' buffers over NVLink), median microseconds each
   over 200 calls, so the faster one can become the default (NCCL until this is measured);
2. TP=1 against TP=N through the offline engine (bf16): batch-1 decode tokens/s, TTFT of a
   128- and an 8192-token prompt (fresh prompts, median of 3), and throughput of 256
   requests of 512 random tokens in / 256 out at once (output tokens/s);
3. the all-reduces' share of a TP=N decode step: 2 per layer (after o_proj and down_proj)
   at one token each, by each implementation's measured median, over the step's time;
4. greedy tokens of TP=N against TP=1 in bf16 (the common prefix: sums in another order
   may part at a near-tie) and in float32 (must be equal).

    python benchmarks/tp_bench.py --model DIR --tp 2 [--out results.jsonl]

Needs N GPUs. JSON lines on stdout (and appended to --out). Data parallelism through the
router: benchmarks/dp_bench.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (1, 8, 32, 128, 512)  # tokens in the step


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group_name = dist.group.WORLD.group_name
    rows = []
    for tokens in SIZES:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        timings = {}
        for name in ("nccl", "symm_mem_one_shot"):
            if name == "nccl":
                def op():
                    dist.all_reduce(x)
            else:
                try:
                    import torch.distributed._symmetric_memory as symm_mem
                    buf = symm_mem.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
                    symm_mem.rendezvous(buf, group_name)
                    buf.copy_(x)

                    def op():
                        torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
                except Exception as e:  # not available on this build or machine: say so
                    timings[name] = f"unavailable: {type(e).__name__}: {e}"[:200]
                    continue
            for _ in range(20):
                op()
            torch.cuda.synchronize()
            samples = []
            for _ in range(200):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                op()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            timings[name] = sorted(samples)[len(samples) // 2]
        rows.append({"bench": "tp_allreduce", "world": world, "tokens": tokens, "hidden": hidden,
                     "bytes": tokens * hidden * 2, "median_us": timings})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def allreduce_bench(world: int, hidden: int) -> list[dict]:
    from expresslane.runner.tensor_parallel import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_allreduce_rank, args=(world, free_port(), hidden, queue), nprocs=world, start_method="spawn")
    return queue.get()


def engine_bench(model: str, tp: int, dtype: str = "bfloat16", new_tokens: int = 128, full: bool = True,
                 max_model_len: int = 9216) -> tuple[dict, list[int]]:
    """(figures, the greedy tokens of a 128-token prompt) of one engine at tensor-parallel size `tp`."""
    from expresslane import LLM, SamplingParams
    from expresslane.bench.inprocess import random_prompts

    llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, max_model_len=max_model_len)
    vocab = llm.engine.core.hf_config.vocab_size
    rng = random.Random(0)

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def run(prompts: list[list[int]], n: int):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)

    prompt = list(range(100, 228))
    run([prompt], new_tokens)  # warm-up
    [out] = run([prompt], new_tokens)
    m = out.metrics
    row = {"bench": "tp_engine", "model": os.path.basename(model.rstrip("/")), "tp": tp, "dtype": dtype,
           "ttft_128_ms": (m.first_token_time - m.arrival_time) * 1e3,
           "decode_tokens_per_s": (new_tokens - 1) / (m.finished_time - m.first_token_time),
           "decode_step_ms": (m.finished_time - m.first_token_time) / (new_tokens - 1) * 1e3}
    if full:
        for n in (128, 8192):
            ttfts = [(o.metrics.first_token_time - o.metrics.arrival_time) for o in
                     (run(random_prompts(rng, vocab, [n]), 1)[0] for _ in range(3))]
            row[f"ttft_{n}_median_ms"] = statistics.median(ttfts) * 1e3
        prompts = random_prompts(rng, vocab, [512] * 256)
        t0 = time.perf_counter()
        outs = run(prompts, 256)
        row["throughput_256x512_256_out_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (
            time.perf_counter() - t0)
    llm.shutdown()
    del llm  # its weights and KV cache, before the next engine takes the GPUs
    gc.collect()
    torch.cuda.empty_cache()
    return row, out.outputs[0].token_ids


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    rows = allreduce_bench(args.tp, cfg["hidden_size"])
    (one, ref), (many, got) = engine_bench(args.model, 1), engine_bench(args.model, args.tp)
    many["bf16_tokens_equal_to_tp1_before_first_difference"] = common_prefix(ref, got)
    one_token = next(r for r in rows if r["tokens"] == 1)["median_us"]
    many["allreduce_share_of_decode_step"] = {  # 2 per layer, one token each
        name: 2 * cfg["num_hidden_layers"] * us / 1e3 / many["decode_step_ms"] for name, us in one_token.items()}
    (_, ref32), (_, got32) = (engine_bench(args.model, n, "float32", 64, full=False) for n in (1, args.tp))
    many["float32_greedy_equal_to_tp1"] = ref32 == got32
    many["float32_tokens_equal_before_first_difference"] = common_prefix(ref32, got32)
    rows += [one, many]
    for row in rows:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
