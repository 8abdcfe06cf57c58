"""The fused decode layer (``fused_decode_layer``, issue #42 item 1), switch off vs on.

    python benchmarks/fused_layer_bench.py [--model DIR] [--batches 1,8] [--out results.jsonl]
    python benchmarks/fused_layer_bench.py --smoke   (CPU: Triton's interpreter, a tiny layer)

1. One dense layer of the Llama-3-8B shape (hidden 4096, intermediate 14336, 32 q / 8 kv heads
   of 128; random weights), batch 1 and 8, each seq decoding at 1k and 32k tokens of context:
   ``fused_layer``: us per layer (a CUDA graph of 32 calls of the layer, replayed, divided by
   the calls) off, on (the attention's splits combined by a second kernel, as the tables
   choose), and on with a one-launch attention (``on_one_launch``: the last split combines
   them; ``--fused-splits``: also with at most that many splits); the weight-read floor at the copy bandwidth measured here, kernel
   launches per layer (torch.profiler over one eager call: each kernel's name and us), and
   the on-vs-off difference of the layer's output (the residual stream after it), relative
   to its largest value.
2. With ``--model``: the whole engine, batch-1 decode, off then on (two engines one after the
   other): ``fused_layer_model`` tok/s over 256 tokens, the floor, kernels per decode step
   (torch.profiler over 10 steady steps) and whether the switch applied;
   ``fused_layer_model_compare``: the speed-up, kernels per step off and on, and the greedy
   tokens' first divergence (None: all 257 equal).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch
from _shared import copy_bandwidth, emit, graph_us, kernel_intervals, launch_steps, prompts_of

SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, vocab_size=256)
SHAPE_SMOKE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, vocab_size=64)
CALLS = 32  # layer calls per graph: a decode step's worth of layers
BLOCK = 16
GIB = 2**30 / 1e9  # the floor's copy: a 1 GiB tensor


def one_layer(shape: dict, device: torch.device, dtype: torch.dtype):
    """A one-layer Llama of `shape` on the triton backend, random weights and norm weights."""
    from transformers import LlamaConfig

    from expresslane.attention.registry import get_backend
    from expresslane.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=1, **shape)
    backend = get_backend("triton", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, device, dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, backend).eval()
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.uniform_(0.5, 1.5, generator=g)
    return model, backend


def decode_inputs(model, backend, batch: int, context: int, device: torch.device, dtype: torch.dtype):
    """A decode step of `batch` seqs at `context` tokens over a random cache: (positions,
    hidden, residual, meta); the cache is bound to the layer."""
    from expresslane.attention.backend import AttentionMetadata

    cfg, attn = model.config, model.layers[0].self_attn
    width = -(-context // BLOCK)
    attn.kv_cache = torch.randn(2, batch * width, BLOCK, attn.num_kv_heads, attn.head_dim, device=device,
                                dtype=dtype) * 0.5
    lens = [context] * batch
    tables = [[i * width + j for j in range(width)] for i in range(batch)]
    slots = [tables[i][(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)]
    starts = list(range(batch + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), block_tables=torch.tensor(tables, dtype=torch.int32,
                                                                                   device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device), num_decodes=batch,
        seq_lens_cpu=lens, query_start_loc_cpu=starts, max_decode_seq_len=context)
    backend.prepare(meta)
    positions = torch.full((batch,), context - 1, device=device)
    x = torch.randn(batch, cfg.hidden_size, device=device, dtype=dtype)
    residual = torch.randn(batch, cfg.hidden_size, device=device, dtype=dtype) * 4
    return positions, x, residual, meta


def layer_bytes(layer) -> int:
    attn, mlp = layer.self_attn, layer.mlp
    return sum(p.weight.numel() * p.weight.element_size()
               for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


def kernels_of(call) -> list[tuple[str, float]]:
    """(name, us) of the GPU activities of one eager call (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [(name, e - s) for s, e, name in kernel_intervals(prof)]


def layer_bench(args, out) -> None:
    smoke = args.smoke
    device, dtype = torch.device("cpu" if smoke else "cuda"), torch.float32 if smoke else torch.bfloat16
    shape = SHAPE_SMOKE if smoke else SHAPE_8B
    bw = None if smoke else copy_bandwidth(GIB)
    measure = lambda call: (graph_us([call] * CALLS, reps=20), kernels_of(call))  # noqa: E731
    for context in args.contexts:
        for batch in args.batches:
            model, backend = one_layer(shape, device, dtype)  # a fresh layer each time: off first, then folded
            layer = model.layers[0]
            positions, x, residual, meta = decode_inputs(model, backend, batch, context, device, dtype)
            h_in = x + residual  # the fused layer's input: the residual stream itself
            off = lambda: layer(positions, x, residual, meta)  # noqa: E731  (today's layer: hidden, residual)
            on = lambda: layer(positions, h_in, None, meta)  # noqa: E731
            timings = {}
            with torch.inference_mode():
                y, r = off()
                want = (y + r).float()
                if not smoke:
                    timings["off"] = measure(off)
                model.enable_fused_decode()  # the norms' weights move into the QKV and gate|up weights
                backend.prepare(meta)  # the decode tile whose splits combine themselves
                got, none = on()
                if none is not None:
                    raise RuntimeError("the fused decode path did not run")
                got = got.float()
                if not smoke:
                    timings["on"] = measure(on)
                    tables, tile = backend.decode_tiles, backend.decode_tile(batch)
                    for most in [tile.max_splits, *args.fused_splits]:  # one launch: the last split combines
                        one = dataclasses.replace(tile, fused_reduce=True, max_splits=most)
                        backend.decode_tiles = {backend.d_pad: ((0, one),)}
                        backend.prepare(meta)
                        timings["on_one_launch" + ("" if most == tile.max_splits else f"_splits{most}")] = measure(on)
                    backend.decode_tiles = tables
            err = float((got - want).abs().max() / want.abs().max())
            row = dict(bench="fused_layer", shape="smoke" if smoke else "llama-3-8b", batch=batch, context=context,
                       max_rel_diff_on_vs_off=err)
            if not smoke:
                floor_us = layer_bytes(layer) / bw * 1e6
                row.update(floor_us=round(floor_us, 2), copy_tb_per_s=round(bw / 1e12, 3))
                for mode, (us, kernels) in timings.items():
                    row[f"{mode}_us"] = round(us, 2)
                    row[f"{mode}_pct_of_floor"] = round(100 * floor_us / us, 1)
                    row[f"{mode}_launches"] = len(kernels)
                    row[f"{mode}_kernels_us"] = [(name[:50], round(t, 2)) for name, t in kernels]
                row.update(speedup=round(row["off_us"] / row["on_us"], 3),
                           speedup_one_launch=round(row["off_us"] / row["on_one_launch_us"], 3))
            emit(out, **row)
            del model, backend, layer, meta


def engine_run(args, fused: bool, bw: float, out) -> tuple[list[int], dict]:
    """Batch-1 decode of the model, the switch as given: its row (emitted and returned) and the
    greedy tokens."""
    from torch.profiler import ProfilerActivity, profile

    from expresslane import LLM, SamplingParams
    from expresslane.bench.floors import decode_weight_bytes

    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm = LLM(args.model, dtype="bfloat16", max_num_seqs=8, gpu_memory_utilization=0.85,
              load_format=args.load_format, fused_decode_layer=fused)
    eng, core = llm.engine, llm.engine.core
    vocab = core.hf_config.vocab_size
    llm.generate([{"prompt_token_ids": prompts_of(1, 128, vocab, 5)[0]}], greedy(32), use_tqdm=False)  # warm-up
    [o] = llm.generate([{"prompt_token_ids": prompts_of(1, 128, vocab, 1)[0]}], greedy(257), use_tqdm=False)
    per_tok = (o.metrics.finished_time - o.metrics.first_token_time) / 256
    eng.add_request("profiled", {"prompt_token_ids": prompts_of(1, 128, vocab, 2)[0]}, greedy(64))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running.values()) \
            or core.scheduler.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        launch_steps(eng, steps)
        torch.cuda.synchronize()
    while eng.has_unfinished():
        eng.step()
    [(weight_bytes, fused_rows)] = llm.apply_model(
        lambda model: (decode_weight_bytes(model, 1), [layer.fused_rows for layer in model.layers]))
    floor_ms = weight_bytes / bw * 1e3
    row = dict(bench="fused_layer_model", model=args.model, fused=fused, applied=all(fused_rows),
               tokens_per_s=1 / per_tok, ms_per_token=per_tok * 1e3, floor_ms=floor_ms,
               pct_of_floor=100 * floor_ms / (per_tok * 1e3), kernels_per_step=len(kernel_intervals(prof)) / steps,
               layers=len(fused_rows))
    emit(out, **row)
    tokens = list(o.outputs[0].token_ids)
    del llm, eng, core
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, row


def model_bench(args, out) -> None:
    bw = copy_bandwidth(GIB)
    runs = {}
    for fused in (False, True):
        t0 = time.perf_counter()
        runs[fused] = engine_run(args, fused, bw, out)
        print(f"engine fused={fused}: {time.perf_counter() - t0:.0f} s", flush=True)
    (off, off_row), (on, on_row) = runs[False], runs[True]
    first = next((i for i, (a, b) in enumerate(zip(off, on)) if a != b), None)
    emit(out, bench="fused_layer_model_compare", model=args.model, tokens=len(off), first_divergence=first,
         speedup=on_row["tokens_per_s"] / off_row["tokens_per_s"], kernels_per_step_off=off_row["kernels_per_step"],
         kernels_per_step_on=on_row["kernels_per_step"],
         kernels_saved_per_layer=(off_row["kernels_per_step"] - on_row["kernels_per_step"]) / on_row["layers"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory: also the whole engine off vs on")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 32768],
                    help="tokens of context each decoding seq of the one-layer part has")
    ap.add_argument("--fused-splits", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="also time the one-launch attention (its last split combines) with at most these many splits")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton's interpreter), a tiny layer: on vs off only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.contexts = [min(c, 40) for c in args.contexts]
    layer_bench(args, args.out)
    if args.model and not args.smoke:
        model_bench(args, args.out)


if __name__ == "__main__":
    main()
