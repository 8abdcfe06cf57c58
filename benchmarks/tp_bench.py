"""Tensor parallelism on one host's GPUs (issue #12; figures for issue #13):

1. small all-reduces, the size of one decode step's o_proj/down_proj outputs (tokens x
   hidden, bf16): NCCL's all_reduce against torch.distributed._symmetric_memory's one-shot
   all-reduce (each rank reads the others' buffers over NVLink), median microseconds each
   over 200 calls, so the faster one can become the default (NCCL until this is measured);
2. batch-1 decode tokens/s and TTFT of a 128-token prompt, TP=1 against TP=N, through the
   offline engine.

    python benchmarks/tp_bench.py --model DIR --tp 2 [--out results.jsonl]

Needs N GPUs. JSON lines on stdout (and appended to --out).
"""

from __future__ import annotations

import argparse
import json
import os
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
    from expresslane.distributed.executor import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_allreduce_rank, args=(world, free_port(), hidden, queue), nprocs=world, start_method="spawn")
    return queue.get()


def engine_bench(model: str, tp: int, new_tokens: int = 128) -> tuple[dict, list[int]]:
    from expresslane import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, dtype="bfloat16", max_model_len=2048)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 228))}
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    [out] = llm.generate([prompt], params, use_tqdm=False)
    total = time.perf_counter() - t0
    m = out.metrics
    ttft = m.first_token_time - m.arrival_time
    row = {"bench": "tp_engine", "model": os.path.basename(model.rstrip("/")), "tp": tp,
           "ttft_128_ms": ttft * 1e3, "decode_tokens_per_s": (new_tokens - 1) / (m.finished_time - m.first_token_time),
           "total_s": total}
    if tp > 1:
        llm.engine.core.runner.shutdown()
    return row, out.outputs[0].token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    hidden = json.load(open(os.path.join(args.model, "config.json")))["hidden_size"]
    rows = allreduce_bench(args.tp, hidden)
    (one, ref), (many, got) = engine_bench(args.model, 1), engine_bench(args.model, args.tp)
    # bf16 sums in another order: greedy paths may part after a near-tie; the common prefix says where
    many["tokens_equal_to_tp1_before_first_difference"] = next(
        (i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    rows += [one, many]
    for row in rows:
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
