"""Print the GPU results (JSON lines) as one short table."""

import json
import sys


def fmt(r: dict) -> str:
    if "probe" in r:
        return fmt_lora_probe(r)
    if "bench" not in r:
        return fmt_mla(r)
    b = r["bench"]
    if b == "decode_batch1":
        if "mode" in r:
            return f"{r['mode']:<14} decode_batch1            {r['tokens_per_s']:8.1f} tok/s"
        extra = f"  {r['pct_of_floor']:.0f}% of {r['floor_ms']:.2f} ms floor" if "pct_of_floor" in r else ""
        if "pct_of_measured_floor" in r:
            extra += f", {r['pct_of_measured_floor']:.0f}% at this GPU's {r['copy_tb_s']:.2f} TB/s copy"
        return f"batch-1 decode        {r['tokens_per_s']:8.1f} tok/s  {r['ms_per_token']:6.2f} ms/tok{extra}"
    if b == "ttft":
        extra = f"  {r['prefill_tflops']:.0f} TFLOP/s ({r['pct_of_peak']:.0f}% of 805)" if "prefill_tflops" in r else ""
        return f"TTFT {r['prompt_len']:>5} tokens     {r['ttft_ms']:8.1f} ms{extra}"
    if b == "decode_throughput":
        busy = r.get("gpu_busy_fraction")
        extra = f"  GPU busy {100 * busy:.0f}%" if busy else ""
        if "weight_floor_tokens_per_s" in r:
            extra += f"  (weight-read bound {r['weight_floor_tokens_per_s']:.0f} tok/s)"
        if "fewest_seqs" in r:
            extra += f"  fewest seqs a step {r['fewest_seqs']}"
        return f"decode batch {r['batch']:>3} @1k ctx {r['tokens_per_s']:8.0f} tok/s  {r['step_ms']:6.1f} ms/step{extra}"
    if b in ("decode_batch1_no_adapter", "decode_batch64"):
        extra = f" over {r['adapters']} adapters" if r.get("adapters") else ""
        return f"{r['mode']:<14} {b:<24} {r['tokens_per_s']:8.1f} tok/s{extra}"
    if b == "cold_load":
        worst = "; ".join(f"{w['ms']:.1f}{' A' if w['arrival'] else ''}{' L' if w['loads'] else ''}"
                          f"{' a' if w['arrival_outputs'] else ''}" for w in r.get("worst_steps", []))
        steps = f"; steps p50 {r['step_p50_ms']:.2f} p99 {r['step_p99_ms']:.2f}, worst {worst}" if worst else ""
        return (f"{r['mode']:<6} 16 streams, arrivals {r['case']:<4} ITL p50 {r['itl_p50_ms']:5.2f} p99 "
                f"{r['itl_p99_ms']:6.2f} max {r['itl_max_ms']:6.2f} ms, {r['slot_loads']} slot loads{steps}")
    if b == "bf16_top1_agreement":
        return (f"bf16 top-1 agreement  {100 * r['agreement']:.2f}% of {r['positions']} positions "
                f"({r.get('text', 'random ids')}), "
                f"{100 * r['agreement_clear']:.2f}% where the top-2 margin is clear")
    if b == "spec_decode":
        acc = "" if r.get("acceptance_rate") is None else \
            f"  acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_verify']} tok/verify"
        speed = f"  {r['speedup']:.2f}x none, same tokens {r['same_tokens_as_none']}" if "speedup" in r else ""
        return (f"spec {r['method']:<11} {r['workload']:<10} b={r['batch']:<3} {r['decode_tok_s_per_request']:7.1f} "
                f"tok/s/request{speed}{acc}")
    if b == "spec_decision":
        costs = "; ".join(f"{k.removeprefix('batch_')}: {p:.3f} vs {q:.3f}"
                          for k, (p, q) in r["predicted_ms_per_token_plain_spec"].items())
        return (f"spec {r['method']:<11} predicted ms/token plain vs speculating, by batch: {costs} "
                f"(acceptance {r['acceptance']}, verify scale {r['verify_scale']}); {r['cost_model']}")
    if b == "lanes_scenario":
        return (f"lanes {r['mode']:<17} long={r['long_lane']:<11} short P99 {r['short_mixed_p99_ms']:6.1f} ms "
                f"({r['short_p99_ratio']:.2f}x alone)  long TTFT {r['long_mixed_ms']:6.1f} ms "
                f"({r['long_growth']:.2f}x background, {r['long_vs_alone']:.2f}x alone)")
    if b == "pd_lanes":
        bl, m = r.get("beside_long", {}), r.get("mixed", {})
        return (f"pd {r['config']:<8} ({r['partitions'] or 'one stream'}) beside 8k: short TTFT "
                f"{bl.get('short_ttft_ratio', 0):.2f}x total {bl.get('short_total_ratio', 0):.2f}x long "
                f"{bl.get('long_ratio', 0):.2f}x; mixed: ITL p99 {m.get('itl_ratio', 0):.2f}x batch-1, long TTFT p50 "
                f"{m.get('long_ttft_p50', 0):.0f} ms")
    if b == "flat_acceptance":
        def x(k):
            return "-" if r.get(k) is None else f"{r[k]:.2f}"
        return (f"flat {r['config']:<8} beside 8k: short TTFT {x('short_ttft_ratio')}x total {x('short_total_ratio')}x "
                f"long {x('long_ttft_ratio')}x; mixed p99 {x('mixed_short_ttft_p99_ms')} ms ITL p99 "
                f"{x('mixed_itl_p99_vs_batch1')}x; goodput {x('peak_good_per_s')}/s; HTTP/engine 8k "
                f"{x('http_vs_engine_long')}; {x('output_tok_per_s')} tok/s")
    if b == "tp_engine":
        tput = r.get("throughput_256x512_256_out_tok_s")
        extra = "" if tput is None else (f", TTFT 128/8192 {r['ttft_128_median_ms']:.1f}/{r['ttft_8192_median_ms']:.0f} ms"
                                         f", 256 x 512/256 {tput:.0f} tok/s")
        if "float32_greedy_equal_to_tp1" in r:
            share = ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["allreduce_share_of_decode_step"].items())
            extra += (f"; float32 greedy = TP=1: {r['float32_greedy_equal_to_tp1']}, bf16 same for "
                      f"{r['bf16_tokens_equal_to_tp1_before_first_difference']} tokens; all-reduce share {share}")
        return f"TP={r['tp']} batch-1 {r['decode_tokens_per_s']:.1f} tok/s{extra}"
    if b == "dp_router":
        return (f"DP={r['dp']} via router: {r['output_tok_per_s']:.0f} out tok/s; beside 8k short TTFT "
                f"{r['short_ttft_ratio']:.2f}x, total {r['short_total_ratio']:.2f}x, long {r['long_ttft_ratio']:.2f}x")
    if b == "dp_speedup":
        return f"DP={r['dp']} / DP=1 throughput {r['throughput_ratio']:.2f}x (bar >= 1.9x)"
    if b == "long_context":
        return (f"long context {r['prompt_tokens']:>5} tokens alone: TTFT {r['ttft_ms']:8.1f} ms, ITL {r['itl_ms']:.2f} ms "
                f"(through HTTP, {r['max_model_len']} context)")
    if b == "batch_drain":
        idle, during, alone, busy = r["idle"], r["during"], r["batch_alone"], r["batch_during"]
        return (f"batch drain {r['num_batch']} req: interactive TTFT p99 {idle['p99_ms']:.1f} -> "
                f"{during['p99_ms']:.1f} ms "
                f"({r['ttft_p99_ratio']}x, target <= 1.5); batch {alone['output_tok_s']:.0f} -> "
                f"{busy['output_tok_s']:.0f} tok/s ({r['batch_tput_ratio']}x, target >= 0.8)")
    if b == "moe_kernels":
        us = r["us"]
        return (f"MoE layer {r['shape']} x{r['tokens']:<3} experts {us['experts_whole']:.1f} us (floor {r['floor_us']:.1f}: "
                f"GEMMs {r['gemm1_gb_s']}/{r['gemm2_gb_s']} GB/s), route {us['route_warps1']:.1f}, align {us['align']:.1f}, "
                f"router matmul {us['router_matmul']:.1f}, sum {us['sum']:.1f}")
    if b == "moe_tile_sweep":
        best = r["best"][0]
        return (f"MoE tiles {r['shape']} x{r['tokens']} {r['gemm']}: default {r['default']} {r['default_us']:.1f} us, "
                f"best {best['tiles']} {best['us']:.1f} us")
    if b == "decode_profile":
        kinds = "  ".join(f"{k.split()[0]} {v:.2f}" for k, v in r["ms_by_kind"].items())
        return (f"decode profile b={r['batch']:<3} step {r['step_ms']:.2f} ms, graph replay {r['replay_ms']:.2f} ms "
                f"(floor {r['floor_ms']:.2f}), busy {r['busy_ms_per_step']:.2f} ms/step; {kinds}")
    if b == "ttft_profile":
        return (f"TTFT profile {r.get('prompt_len', 128):<7} {r['ttft_ms']:.2f} ms: host {r['host_before_first_kernel_ms']:.2f} + GPU span "
                f"{r['gpu_span_ms']:.2f} (busy {r['gpu_busy_ms']:.2f}) + host {r['host_after_last_kernel_ms']:.2f}")
    if b == "gpu_metrics" and r["load_gpu_utilization_perc"] is not None:
        power = "" if r["idle_gpu_power_watts"] is None else \
            f", power {r['idle_gpu_power_watts']:.0f} -> {r['load_gpu_power_watts']:.0f} W"
        return (f"GPU metrics idle -> {r['clients']} clients: utilisation {100 * r['idle_gpu_utilization_perc']:.0f}% -> "
                f"{100 * r['load_gpu_utilization_perc']:.0f}%, memory {r['idle_gpu_memory_used_bytes'] / 2**30:.1f} -> "
                f"{r['load_gpu_memory_used_bytes'] / 2**30:.1f} GiB{power}")
    if b == "fused_layer" and "on_us" in r:
        return (f"fused layer b={r['batch']} @{r['context']}: off {r['off_us']:.1f} us ({r['off_launches']} launches, "
                f"{r['off_pct_of_floor']:.0f}% of floor) -> on {r['on_us']:.1f} us ({r['on_launches']}, "
                f"{r['on_pct_of_floor']:.0f}%) {r['speedup']:.2f}x; one-launch attention "
                f"{r['on_one_launch_us']:.1f} us ({r['on_one_launch_launches']}) {r['speedup_one_launch']:.2f}x; "
                f"on vs off max rel diff {r['max_rel_diff_on_vs_off']:.1e}")
    if b == "fused_layer_model":
        return (f"fused layer {'on ' if r['fused'] else 'off'} (applied {r['applied']}) batch-1 "
                f"{r['tokens_per_s']:7.1f} tok/s ({r['pct_of_floor']:.0f}% of floor), "
                f"{r['kernels_per_step']:.0f} kernels/step")
    if b == "fused_layer_model_compare":
        return (f"fused layer on vs off batch-1 {r['speedup']:.3f}x, kernels/step {r['kernels_per_step_off']:.0f} -> "
                f"{r['kernels_per_step_on']:.0f} ({r['kernels_saved_per_layer']:.1f} fewer a layer); greedy tokens' "
                f"first divergence {r['first_divergence']} of {r['tokens']}")
    quant = fmt_quant(r) or fmt_gemv(r) or fmt_attention(r)
    return quant if quant is not None else json.dumps(r)


def fmt_attention(r: dict) -> str | None:
    """benchmarks/attention_bench.py's rows (issue #18)."""
    b = r["bench"]
    case = f"{r.get('kind')} {r.get('q_len')}@{r.get('context')}"
    if b == "attn_check":
        if "failed" in r:
            return f"attention tile {r['tile']} did not run: {r['failed'][:90]}"
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        return f"attention check {case} {r.get('tile') or r.get('impl')}: rel err vs float32 {err}"
    if b == "attn_prefill":
        if "tflops" not in r:
            return f"prefill {case} {r['impl']} {r.get('tile', '')}: {(r.get('unavailable') or r.get('failed'))[:90]}"
        return (f"prefill {case:<20} {r['impl']:<11} {r['tile']:<22} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s "
                f"({r['pct_of_peak']:.0f}%)")
    if b == "attn_decode":
        return (f"decode attention b={r['batch']} x {r['context']} {r['splits']:>2} splits {r['tile']:<22} "
                f"{r['us']:8.1f} us {r['kv_tb_per_s']:.2f} TB/s ({r['pct_of_bw']:.0f}%)")
    if b == "attn_prefill_best":
        lib = "  ".join(f"{k[:-7]} {v:.0f}" for k, v in r.items() if k.startswith("sdpa_"))
        return (f"prefill {case}: table tile {r['table_tflops']:.0f} TFLOP/s, best {r['best_tile']} "
                f"{r['best_tflops']:.0f}; {lib}")
    if b == "attn_suggest":
        return (f"suggested {r['table']} tile from {r['key']}: {r['tile']} {r['score']} {r['unit']} "
                f"(the table's today: {r['table_score']})")
    if b == "attn_decode_best":
        return (f"decode attention b={r['batch']} x {r['context']}: table {r['table_splits']} splits "
                f"{r['table_tb_per_s']:.2f} TB/s, best {r['best_tile']} ({r['best_splits']} splits) "
                f"{r['best_tb_per_s']:.2f} TB/s")
    return None


def fmt_gemv(r: dict) -> str | None:
    """benchmarks/gemv_bench.py's and kv_attention_bench.py's rows."""
    b = r["bench"]
    if b == "gemv_check":
        return f"GPU vs float32 {r['fmt']:>4} {r['shape']:<7} M={r['m']:<3} max rel err {r['max_rel_err']:.4f} ok={r['ok']}"
    if b == "gemv" and "us" in r:
        vs = f"  {r['speedup_vs_cublas_bf16']:.2f}x bf16 cuBLAS" if "speedup_vs_cublas_bf16" in r else ""
        return (f"{r['fmt']:>4} {r['impl']:<14} {r['shape']:<7} M={r['m']:<5} {r['us']:9.2f} us  "
                f"{r['weight_tb_per_s']:.2f} TB/s ({r['pct_of_bw']:.0f}%){vs}")
    if b == "gemv_decode_step":
        return (f"decode-step linears {r['fmt']:>4} {r['impl']:<7} ({r['configs']}) {r['ms']:.3f} ms  "
                f"{r['weight_tb_per_s']:.2f} TB/s ({r['pct_of_bw']:.0f}% of copy bandwidth)")
    if b == "gemv_fold_check":
        return f"FP8 fold {r['op']:<17} M={r['m']:<3} e4m3 rows and scales equal per_token_quant_fp8: {r['exact']}"
    if b == "gemv_fold":
        return (f"FP8 fold {r['op']:<17} M={r['m']:<3} folded {r['folded_us']:.2f} us, separate "
                f"{r['separate_us']:.2f} us (producer alone {r['producer_alone_us']:.2f}): saves {r['saved_us']:.2f} us")
    if b == "kv_decode_attention":
        return (f"decode attention {r['kv_dtype']} KV, batch {r['batch']} x {r['context']}, {r['tile']}"
                f"{' (table)' if r['in_table'] else ''}: {r['us']:.0f} us  {r['kv_tb_per_s']:.2f} TB/s of KV")
    if b == "kv_decode_attention_best":
        return (f"decode attention {r['kv_dtype']} KV: best {r['tile']} {r['us']:.0f} us ({r['pct_of_bw']:.0f}% of "
                f"bandwidth), table {r['table_tile']} {r['table_us']:.0f} us")
    if b == "kv_decode_attention_ratio":
        return (f"decode attention FP8 / bf16 KV time: {r['fp8_over_bf16_table']:.3f} with the table's tiles, "
                f"{r['fp8_over_bf16_best']:.3f} with each one's best")
    return None


def fmt_mla(r: dict) -> str | None:
    """benchmarks/mla_bench.py's rows (issue #43); of a sweep, each case's best beside today's."""
    if r["case"] == "copy":
        return f"device copy bandwidth {r['tb_per_s']:.2f} TB/s"
    if r["case"] == "decode_best":
        return (f"MLA decode b={r['batch']:<3} @{r['context']:<6} today {r['today_tile']} {r['today_us']:.1f} us "
                f"({r['today_x_floor']:.2f}x floor), fastest {r['best_tile']} {r['best_us']:.1f} us "
                f"({r['best_x_floor']:.2f}x, {r['best_splits']} splits)")
    if r["case"] == "decode" and r.get("sweep"):
        return None
    if r["case"] == "decode":
        return (f"MLA decode b={r['batch']:<3} @{r['context']:<6} {r['us']:8.1f} us  {r['gb_per_s']:7.0f} GB/s  "
                f"{r['x_of_read_floor']:.2f}x the latent read floor ({r['splits']} splits)")
    return f"MLA prefill {r['chunk']} after {r['cached']}  {r['ms']:.3f} ms  {r['tflop_per_s']:.0f} TFLOP/s"


def fmt_lora_probe(r: dict) -> str:
    """benchmarks/lora_probe.py's rows (issue #41)."""
    if r["probe"] == "copy_engine":
        return (f"84 MB slot copy {r['big_copy_ms']:.2f} ms; a step's input copy alone {r['small_alone_ms']:.3f} ms, "
                f"beside it {r['small_beside_one_copy_ms']:.3f}, beside it in 8 / 64 pieces "
                f"{r['small_beside_8_pieces_ms']:.3f} / {r['small_beside_64_pieces_ms']:.3f} ms")
    if r["probe"] == "projections_check":
        return f"check {r['variant']:<24} {r['n']}x{r['k']}  max |err| {r['max_abs_err']:.2e} (scale {r['ref_scale']:.2f})"
    if r["probe"] == "projections_profile":
        top = "; ".join(f"{k['name'][:40]} {k['ms']:.3f} ms x{k['launches']}" for k in r["kernels"][:4])
        return f"  profile {r['variant']:<24} busy {r['busy_ms']:.3f} of {r['span_ms']:.3f} ms: {top}"
    return f"projections {r['variant']:<24} {r['step_ms']:7.3f} ms a step  {r['per_projection_us']:6.2f} us each"


def fmt_quant(r: dict) -> str | None:
    """benchmarks/quant_bench.py's rows (issue #16)."""
    b = r["bench"]
    if b == "quant_fp8_peak":
        return f"FP8 GEMM peak (8192^3 _scaled_mm) {r['tflops']:.0f} TFLOP/s (bf16 peak {r['bf16_peak_tflops']:.0f})"
    if b == "quant_engine":
        return (f"loaded in {r['load_s']:.0f} s: weights {r['weight_gb']:.2f} GB, KV capacity {r['kv_tokens']:,} tokens "
                f"({r['kv_dtype']})")
    if b == "quant_decode_batch1":
        return (f"batch-1 decode        {r['tokens_per_s']:8.1f} tok/s  {r['pct_of_floor']:.0f}% of the "
                f"{r['floor_tokens_per_s']:.0f} tok/s floor ({r['floor_ms']:.2f} ms)")
    if b == "quant_ttft":
        return (f"TTFT {r['prompt_len']:>5} tokens     {r['ttft_ms']:8.1f} ms  {r['prefill_tflops']:.0f} TFLOP/s "
                f"({r['pct_of_fp8_peak']:.0f}% of FP8 peak, {r['pct_of_bf16_peak']:.0f}% of bf16)")
    if b == "quant_throughput":
        return (f"throughput {r['prompts']} x {r['input_len']}/{r['output_len']}  {r['output_tokens_per_s']:8.0f} "
                f"output tok/s")
    if b == "quant_long_decode":
        return f"decode batch {r['batch']} @{r['context']} ctx {r['tokens_per_s']:8.0f} tok/s  {r['step_ms']:6.1f} ms/step"
    if b == "quant_accuracy":
        return (f"vs bf16 ({r['texts']} texts x {r['tokens_per_text']}): top-1 agreement "
                f"{r['top1_agreement']:.4f} ± {r['top1_agreement_se']:.4f}, KL {r['kl']:.5f} ± {r['kl_se']:.5f}, "
                f"perplexity {r['perplexity']:.2f} vs {r['perplexity_bf16']:.2f} ({r['perplexity_diff']:+.3f})")
    if b == "quant_greedy_vs_cpu":
        return (f"GPU greedy == CPU reference ({r['engine']}, short prompts): float32 {r['float32_identical']}/"
                f"{r['prompts']}, bfloat16 {r['bfloat16_identical']}/{r['prompts']}")
    return None


rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
last = None
for r in rows:
    key = (r.get("model"), r.get("engine", ""), r.get("label"))
    if key != last:
        print(f"-- {key[0]}  {key[1]}" + (f" [{key[2]}]" if key[2] else "") + (f"  ({r['backend']}, graphs={r['cuda_graphs']})" if "backend" in r else ""))
        last = key
    if (line := fmt(r)) is not None:
        print("   " + line)
