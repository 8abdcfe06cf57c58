#!/usr/bin/env bash
# Everything that needs a GPU, in one call: install, GPU tests, benchmarks; a table last.
# Usage (device machine, repo root):  bash benchmarks/gpu.sh [SECTION...]   (default: full)
#   small:   bf16 agreement, step profile, engine benchmarks on the qwen2.5-0.5b shape
#   8b, 7b:  expresslane and transformers benchmarks on the Llama-3-8B / Qwen2.5-7B shapes
#   8b-engine: expresslane alone on the Llama-3-8B shape; ENGINE_BENCHES=decode,ttft: a subset; BASELINE_TREE=DIR
#            (an older checkout's package) measures the same first, in the same call
#   profile: where a decode step's and a short prompt's time goes (8B shape)
#   fused:   our Triton fused ops against torch.compile and eager (8B shapes)
#   layer:   issue #42 item 1, the fused decode layer (--fused-decode-layer) off vs on: its kernel tests in
#            bf16, one 8B layer at batch 1 and 8 (us and launches per layer vs the weight-read floor), then
#            llama-3-8b batch-1 decode in the engine (tok/s, kernels per step, greedy tokens' first divergence)
#   families: issue #43 on the real shapes (weights generated on the GPU): batch-1 decode against the
#            weight-read floor (active weights for MoE; also at this GPU's measured copy bandwidth) and TTFT
#            128 / 8192, expresslane then transformers (at most 100 s each), for FAMILIES (default gemma-3-12b
#            phi-4 deepseek-v2-lite gpt-oss-20b; FAMILIES_HF=0: no transformers; BASELINE_TREE=DIR: an older
#            checkout's package first, in the same call); then the MLA latent kernel (mla_bench.py: decode at 1k-32k
#            keys against the latent read floor, a prefill chunk); MLA_BENCH=0 leaves it out
#   mxfp4:   issue #43: gpt-oss-20b's MXFP4 experts alone (moe_kernel_bench.py --shapes gpt-oss-20b): one layer at
#            1-2048 tokens in the GEMMs' decode, decoded whole and in one-row tiles (no tensor cores); tiles swept
#            at 1 and 4 tokens, one-row tiles among them; ~3 min
#   familyprofile: issue #43: where batch-1 decode and TTFT 128 / 8192 spend GPU time (decode_profile.py, kernels
#            by kind and by name) for FAMILIES (default deepseek-v2-lite gemma-3-12b), real shapes, weights on the GPU
#   fusedgemv: issue #42: the fused layer's four GEMVs (norm / residual / SiLU folded in) one by one against
#            the kernels they replace, tiles and splits swept at batch 1, the best at 1 and 8 (fused_gemv_sweep.py;
#            FUSED_GEMV_QUICK=1: two tiles); ~3 min
#   lora:    issue #41: llama-3-8b base (no adapters) then with rank-16 adapters on every projection
#            (benchmarks/lora_bench.py): batch-1 decode with one adapter, batch 64 over 8 adapters, and 16
#            streams' inter-token p99 while arrivals name adapters in slots (warm) or only in host memory (cold);
#            BASELINE_TREE=DIR (an older checkout's package) measures its adapters' decode first (LORA_BASELINE_ARGS,
#            default --no-cold); LORA_MODES (default "base lora"); LORA_ARGS: more lora_bench.py arguments
#   loraprobe: issue #41: the copy engine beside a slot load, and one decode step's projections per LoRA path
#            (benchmarks/lora_probe.py; no model)
#   tiles:   issue #43: launch-shape sweeps of the new families' attention: the latent kernel's decode at 8k keys
#            (mla_bench.py --sweep: keys a loop, warps, stages, splits) and decode attention at gemma-3-12b's
#            16:8:256 layer (attention_bench.py --shape, batch 1-64 over 1k-4k keys); ~3 min
#   models:  issue #43/#41 on CUDA: Gemma 2/3, Phi-3, RoPE linear/dynamic/YaRN, sliding windows, LoRA and
#            embeddings (tests/test_gpu_models.py; MODELS_K: a pytest -k expression)
#   lanes:   issue #6's scenario (16 short requests arriving while an 8k prompt and 32
#            batch requests run) under static, continuous and continuous-lanes, 8B
#            shape, with the long prompt interactive and then in the batch lane
#   metrics: the server's NVML gauges (utilisation, memory, power) idle, then under 32 streaming
#            clients (llama-3-8b shape; needs the server wheels and nvidia-ml-py in .whl/)
#   flat:    issue #20's acceptance through HTTP (bench doctor's scenarios, goodput sweep 8-32
#            req/s x 10 s, throughput 256 x 512/256) for `serve MODEL --dtype bfloat16` with
#            no other flags (deadline), then with --scheduling-policy fcfs, back to back (8B
#            shape); FLAT_CONFIGS="--config NAME=FLAGS ..." measures others instead
#   replay:  issue #20's mixed load (bench scenarios' arrivals, 8 req/s x 20 s, 15% 8k) replayed into the
#            offline engine in real time (no HTTP), deadline then fcfs (REPLAY_POLICIES), next to flat_sim's
#            prediction for the same arrivals; cost-model refits, each long prompt's chunks, the steps
#            around the worst short request, the stalls (8B shape); then step_cost_check.py: the start-up
#            cost model against that load's step shapes (1-5 decodes beside a 16-512-token chunk after 0-8k keys;
#            REPLAY_CHECK=0 leaves it out)
#   gap:     where the server loses against the engine (8B shape): TTFT of 128 tokens through HTTP split into
#            engine / in / out, and 256 x 512/256 throughput through HTTP (with the engine's steps and busy
#            time from /metrics) against the same run in-engine; default then fcfs (GAP_CONFIGS); then that run
#            in-engine step by step (throughput_steps.py: prefill / mixed / decode steps vs floors), its step
#            shapes and a lone prompt's step (16-2048 tokens) timed alone and profiled by kernel
#            (step_cost_check.py --shapes); GAP_SERVE=0 leaves the server part out; ~7 min
#   batch:   issue #15's batch tier: a 2,000-request Batch API batch (256 in / 128 out) drains,
#            alone and while Poisson interactive shorts (64 in / 16 out, 4/s) run; interactive
#            TTFT p99 vs idle, batch throughput vs alone (8B shape; needs the server wheels and
#            python-multipart in .whl/, else the input file goes straight into the store); ~3 min
#   bench:   expresslane bench one-batch, flat-latency (with transformers) and throughput on
#            the qwen2.5-0.5b shape in bf16: the bench package on CUDA (result JSON beside)
#   quant:   issue #16: FP8 (W8A8) and AWQ INT4 weights and an FP8 KV cache against bf16, 8B
#            shape (decode vs floor, TTFT, 8k prefill TFLOP/s, 256 x 512/256 throughput, batch 64
#            at 8k, KV capacity, accuracy vs bf16), GPU greedy vs the CPU reference per format;
#            QUANT_ARGS="--tput-output 128 --texts 2 --text-len 128": the shortened run (~5 min)
#   gemv:    decode GEMVs and quantized linears per kernel and 8B shape (bf16 / FP8 / INT4, 1..16
#            rows, INT4 prompt paths): TB/s vs the H200 and vs bf16 cuBLAS; GEMV_SWEEP=1 adds
#            the tile-shape and split sweep (~1 min more); decode attention over a bf16 vs an FP8
#            KV cache (batch 64 x 8k, one layer), the table's tile and a sweep of decode tiles
#   tp:      issue #12/#13 (needs 2 GPUs): NCCL all-reduce vs symmetric-memory one-shot all-reduce
#            at decode sizes (8B hidden size) and their share of a TP=2 decode step; batch-1 decode,
#            TTFT 128 / 8192 and 256 x 512/256 throughput at TP=1 vs TP=2 (NCCL, CUDA graphs per
#            rank); greedy tokens TP=2 vs TP=1 in bf16 (common prefix) and float32 (equal); then
#            DP=1 vs DP=2 through the router (throughput, 16 shorts beside an 8k prompt)
#   moe:     issue #17: qwen3-30b-a3b shape (batch-1 decode vs the active-weight floor, TTFT 128 and 8192,
#            decode throughput at batch 64 and 256) then transformers on the same shape (its random init),
#            and mixtral-8x7b batch-1 decode, and qwen3-30b-a3b with AWQ (INT4) experts batch-1 decode, then a
#            kernel profile of qwen3-30b-a3b decode steps (decode_profile.py: experts, routing, matmul, attention)
#            after the MoE kernels alone at decode sizes (moe_kernel_bench.py: each piece, tiles swept);
#            weights generated on the GPU (--load-format dummy: 61 and 93 GB do not go through the disk);
#            the fused MoE kernel tests ran with the GPU tests; ~6 min
#   hostile: issue #19: one hostile request (10 MB prompt, 300k stop strings, n=128 with logprobs=20,
#            the largest token-id batch) beside two streams and a /health probe every 20 ms, on the
#            built-in model: /health and the streams' gaps, API RSS (needs the server wheels and
#            httpx's in .whl/: httpx, httpcore, h11, anyio, sniffio, idna, certifi)
#   spec:    issue #11 on the built-in trained pair: bf16 top-1 agreement with transformers on held-out
#            code; speculative decoding (ngram, draft model) vs none at batch 1 and 64 on held-out code
#            completion and edit-style prompts: decode speed-up, acceptance, tokens equal (bf16); ~3 min
#   kernels: issue #18: attention at long context, one layer of the 8B shape: prefill of one 512..32k-token
#            prompt and of 2048-token chunks after 6k / 30k cached tokens for a sweep of tile shapes, vs
#            torch SDPA flash and cuDNN (a chunk: two cuDNN calls merged) (TFLOP/s); decode at batch 1 x 8k / 32k, 64 x 8k, 64 x 1k and 256 x 1k by split count
#            and tile (KV TB/s); every tile checked against float32 first; the attention-tile tests (bf16)
#            before; KERNELS_QUICK=1: fewer tiles and cases
#   split:   a short prefill chunk (16-256 tokens) after 8k / 32k keys, one layer of the 8B shape: prefill
#            items whole vs cut over their keys, at the default and at 4 / 8 waves (us, KV TB/s); the split
#            tests of the attention tiles first (the tables' tiles); SPLIT_TILES=1: chunks of 24-1024 tokens,
#            the split items under 10 other tiles (the tile for chunks after long context)
#   longctx: issue #18 through HTTP (llama-3-8b, `serve --max-model-len 33792 --scheduling-policy fcfs`): TTFT
#            of a 16k and a 32k prompt sent alone and the ITL of their decode, batch-1 ITL at 1k, next to vLLM's
#            and the floors; then TTFT 16k / 32k with `--prefill-attention triton` (the baseline) and with
#            `--max-num-batched-tokens 8192`; then new prompt lengths one after another (new_lengths.py)
#   pdmux:   issue #45: can a prefill (6 GEMMs of 8192 x 4096 x 14336) and a decode (32 GEMVs) run at the same
#            time? plain streams, stream priorities, split GEMMs, CUDA graphs, torch green contexts and a
#            disjoint driver SM split (16 / 32 / 48 SMs for the decode), alone vs together; decode batch 1
#            then 32 (benchmarks/pdmux_overlap.py); ~1 min
#   pdlanes: issue #45 item 1: the two lanes on SM partitions (tests/test_gpu_lanes.py: the split's halves
#            disjoint, a graph replayed on a half stays there, greedy tokens equal transformers'), then
#            16 shorts beside an 8k prompt and Poisson 8 req/s with 15% 8k prompts, in-engine, for the
#            default, fcfs and `pd_lanes on` (benchmarks/pd_lanes_bench.py; PD_CONFIGS replaces the three;
#            llama-3-8b shape); ~5 min
#   structured: issue #39: a json_schema-constrained and a penalized decode's TPOT against plain at batch 1
#            and 64, and a 10-field schema's compile time, cold and cached (8B shape; needs xgrammar,
#            apache-tvm-ffi, pydantic, pydantic-core, annotated-types and typing-inspection wheels in .whl/);
#            BASELINE_TREE=DIR (an older checkout) times the plain decode there too, first
#   quick = small;  full = small 8b 7b.  The GPU tests run once, first, whatever the sections
#   (GPU_SKIP_TESTS=1 leaves them out).
# Results: JSON lines in ${OUT:-out}/gpu-results.jsonl, logs beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_VERBOSITY=error
# The GPU machine lacks the server's packages (fastapi, uvicorn, pydantic, pyzmq, msgspec): the
# caller carries them as wheels in .whl/ (docs/gpu.md); they go to a private site directory.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
OUT="${OUT:-out}"; mkdir -p "$OUT"
RES="$OUT/gpu-results.jsonl"; : > "$RES"
MODELS="${MODELS:-/tmp/expresslane-models}"
SECTIONS="${*:-full}"
SECTIONS="${SECTIONS//quick/small}"; SECTIONS="${SECTIONS//full/small 8b 7b}"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

if [ -z "${GPU_SKIP_TESTS:-}" ]; then  # GPU_SKIP_TESTS=1: benchmarks only (the tests ran on this commit)
  echo "== GPU tests"
  python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 || status=1
  python3 -m pytest -q tests/test_triton_attention.py tests/test_triton_ops.py tests/test_triton_moe.py -p no:cacheprovider 2>&1 \
    | tee -a "$OUT/gpu-tests.log" | tail -3 || status=1
fi

model() {  # build a preset once (weights generated on the GPU)
  [ -d "$MODELS/$1" ] || python3 -m expresslane.cli.main make-model "$1" "$MODELS/$1" --device cuda >/dev/null || status=1
}
run() {  # a benchmark; its JSON lines go to the results file
  "$@" --out "$RES" 2> >(grep -v -e Warning -e '^Loading' -e 'regex pattern' >&2) || status=1
}
shape() {  # expresslane, then transformers, on one preset
  model "$1"
  echo "== $1: expresslane"; run python3 benchmarks/gpu_bench.py --model "$MODELS/$1" --only engine
  echo "== $1: transformers"; run python3 benchmarks/gpu_bench.py --model "$MODELS/$1" --only hf
}

for section in $SECTIONS; do
  case "$section" in
    small)
      model qwen2.5-0.5b
      echo "== bf16 agreement (qwen2.5-0.5b shape)"
      run python3 benchmarks/bf16_agreement.py --model "$MODELS/qwen2.5-0.5b"
      echo "== step profile (qwen2.5-0.5b shape)"
      python3 benchmarks/step_profile.py --model "$MODELS/qwen2.5-0.5b" --out "$RES" 2>&1 \
        | tee "$OUT/step-profile.txt" | head -45
      echo "== engine benchmarks (qwen2.5-0.5b shape)"
      run python3 benchmarks/gpu_bench.py --model "$MODELS/qwen2.5-0.5b" --only engine ;;
    8b) shape llama-3-8b ;;
    structured)
      model llama-3-8b; echo "== structured outputs (llama-3-8b)"
      if [ -n "${BASELINE_TREE:-}" ]; then  # the plain decode on an older tree (a checkout), in the same call
        PYTHONPATH="$BASELINE_TREE" run python3 benchmarks/structured_bench.py --model "$MODELS/llama-3-8b" --only plain \
          --label baseline
      fi
      run python3 benchmarks/structured_bench.py --model "$MODELS/llama-3-8b" ;;
    8b-engine)  # expresslane alone on the 8B shape (batch-1 decode, TTFT by length, throughput)
      model llama-3-8b
      if [ -n "${BASELINE_TREE:-}" ]; then  # an older tree (a checkout's package) first, in the same call
        echo "== llama-3-8b: expresslane on the baseline tree $BASELINE_TREE"
        PYTHONPATH="$BASELINE_TREE:$PYTHONPATH" run python3 benchmarks/gpu_bench.py --model "$MODELS/llama-3-8b" \
          --only engine --label baseline ${ENGINE_BENCHES:+--benches $ENGINE_BENCHES}
      fi
      echo "== llama-3-8b: expresslane"
      run python3 benchmarks/gpu_bench.py --model "$MODELS/llama-3-8b" --only engine ${ENGINE_BENCHES:+--benches $ENGINE_BENCHES} ;;
    7b) shape qwen2.5-7b ;;
    profile)
      model llama-3-8b
      echo "== decode profile (llama-3-8b)"; run python3 benchmarks/decode_profile.py --model "$MODELS/llama-3-8b" ;;
    fused) echo "== fused ops: Triton vs torch.compile"; run python3 benchmarks/fused_ops_compare.py ;;
    layer)
      model llama-3-8b
      echo "== fused decode layer kernels and a tiny model's layer, on vs off (bf16)"
      python3 -m pytest -q tests/test_fused_layer.py -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu-tests.log" \
        | tail -3 || status=1
      echo "== the fused decode layer off vs on: one layer (8B shape) at batch 1 and 8, then llama-3-8b batch-1 decode"
      run python3 benchmarks/fused_layer_bench.py --model "$MODELS/llama-3-8b" ${FUSED_SPLITS:+--fused-splits $FUSED_SPLITS} ;;
    lora)
      model llama-3-8b
      if [ -n "${BASELINE_TREE:-}" ]; then  # the adapters' decode on an older tree (a checkout), in the same call
        echo "== multi-LoRA on the baseline tree $BASELINE_TREE (no cold loads)"
        PYTHONPATH="$BASELINE_TREE:$PYTHONPATH" run python3 benchmarks/lora_bench.py --model "$MODELS/llama-3-8b" \
          --mode lora ${LORA_BASELINE_ARGS---no-cold} ${LORA_ARGS:-} --label baseline
      fi
      for mode in ${LORA_MODES:-base lora}; do
        echo "== multi-LoRA (llama-3-8b, rank-16 adapters on every projection): $mode"
        run python3 benchmarks/lora_bench.py --model "$MODELS/llama-3-8b" --mode $mode ${LORA_ARGS:-}
      done ;;
    loraprobe)
      echo "== LoRA probes: a slot load beside a step's input copy; one step's projections per LoRA path"
      run python3 benchmarks/lora_probe.py ;;
    tiles)
      echo "== the latent (MLA) decode kernel under other launch shapes (deepseek-v2-lite's 16 heads)"
      run python3 benchmarks/mla_bench.py --sweep
      echo "== decode attention tiles at head dim 256 (gemma-3-12b: 16 query heads, 8 KV heads)"
      run python3 benchmarks/attention_bench.py --shape 16:8:256 --prefill-cases "" \
        --decode-cases 1:1024,1:4096,8:1024,64:1024,64:4096 ;;
    models)
      echo "== new families, RoPE types, sliding windows, LoRA and embeddings on CUDA"
      python3 -m pytest -q tests/test_gpu_models.py ${MODELS_K:+-k "$MODELS_K"} -p no:cacheprovider 2>&1 \
        | tee -a "$OUT/gpu-tests.log" | tail -15 || status=1 ;;
    families)
      for m in ${FAMILIES:-gemma-3-12b phi-4 deepseek-v2-lite gpt-oss-20b}; do
        [ -d "$MODELS/$m-bare" ] || python3 -m expresslane.cli.main make-model $m "$MODELS/$m-bare" --no-weights \
          >/dev/null || status=1
        M=(python3 benchmarks/gpu_bench.py --model "$MODELS/$m-bare" --load-format dummy --benches decode,ttft
           --ttft-lengths 128,8192 --max-model-len 16384)
        if [ -n "${BASELINE_TREE:-}" ]; then  # an older tree (a checkout's package) first, in the same call
          echo "== $m: expresslane on the baseline tree $BASELINE_TREE"
          PYTHONPATH="$BASELINE_TREE:$PYTHONPATH" run "${M[@]}" --only engine --label baseline
        fi
        echo "== $m: expresslane"; run "${M[@]}" --only engine
        if [ "${FAMILIES_HF:-1}" != 0 ]; then
          echo "== $m: transformers (at most 100 s)"
          timeout 100 "${M[@]}" --only hf --out "$RES" || echo "transformers stopped (rc $?)"
        fi
      done
      if [ "${MLA_BENCH:-1}" != 0 ]; then
        echo "== MLA latent attention kernel (deepseek-v2-lite shape)"; run python3 benchmarks/mla_bench.py
      fi ;;
    familyprofile)
      for m in ${FAMILIES:-deepseek-v2-lite gemma-3-12b}; do
        [ -d "$MODELS/$m-bare" ] || python3 -m expresslane.cli.main make-model $m "$MODELS/$m-bare" --no-weights \
          >/dev/null || status=1
        echo "== $m: kernels of a batch-1 decode step and of TTFT 128 / 8192"
        run python3 benchmarks/decode_profile.py --model "$MODELS/$m-bare" --load-format dummy --batches 1 \
          --ttft-lengths 128,8192 --max-model-len 16384
      done ;;
    fusedgemv)
      echo "== the fused layer's GEMVs against the kernels they replace, tiles swept (8B shapes)"
      run python3 benchmarks/fused_gemv_sweep.py ${FUSED_GEMV_QUICK:+--quick} ;;
    lanes)
      model llama-3-8b
      for lane in interactive batch; do
        echo "== lanes scenario (llama-3-8b, long prompt in the $lane lane)"
        run python3 benchmarks/lanes_scenario.py --model "$MODELS/llama-3-8b" --dtype bfloat16 --long-lane $lane
      done ;;
    metrics)
      model llama-3-8b
      echo "== GPU metrics idle vs under load (llama-3-8b)"
      run python3 benchmarks/gpu_metrics.py --model "$MODELS/llama-3-8b" --dtype bfloat16 ;;
    flat)
      model llama-3-8b
      # two configurations fit one 10-minute call; FLAT_CONFIGS replaces them (e.g. "--config
      # default= --config slack2.5=--lane-slo=interactive:slack=2.5")
      echo "== flat latency through HTTP (llama-3-8b): default flags (deadline), then --scheduling-policy fcfs"
      run python3 benchmarks/flat_acceptance.py --model "$MODELS/llama-3-8b" --dtype bfloat16 \
        ${FLAT_CONFIGS:---config default= --config fcfs=--scheduling-policy=fcfs} --duration 20 \
        --sweep-duration 10 --logs "$OUT" ;;
    gap)
      model llama-3-8b
      echo "== where the server loses against the engine (llama-3-8b): TTFT-128 split, throughput through HTTP vs in-engine"
      [ "${GAP_SERVE:-1}" = 1 ] && run python3 benchmarks/serve_gap.py --model "$MODELS/llama-3-8b" --dtype bfloat16 \
        ${GAP_CONFIGS:---config default= --config fcfs=--scheduling-policy=fcfs} --logs "$OUT"
      echo "== the throughput run in-engine, step by step (steps with prefill, mixed, decodes only vs their floors)"
      for pol in deadline fcfs; do
        run python3 benchmarks/throughput_steps.py --model "$MODELS/llama-3-8b" --dtype bfloat16 --flag scheduling_policy=$pol
      done
      echo "== its step shapes timed alone against the start-up model, each profiled by kernel"
      run python3 benchmarks/step_cost_check.py --model "$MODELS/llama-3-8b" --dtype bfloat16 --shapes throughput
      echo "== a prompt's step alone (16-2048 tokens: the isolated TTFT), profiled by kernel"
      run python3 benchmarks/step_cost_check.py --model "$MODELS/llama-3-8b" --dtype bfloat16 --shapes prompts ;;
    replay)
      model llama-3-8b
      echo "== issue #20's mixed load (8 req/s, 15% 8k) replayed into the offline engine, no HTTP: deadline, then fcfs"
      for pol in ${REPLAY_POLICIES:-deadline fcfs}; do
        run python3 benchmarks/replay_mixed.py --model "$MODELS/llama-3-8b" --dtype bfloat16 --flag scheduling_policy=$pol \
          --duration 20
      done
      if [ "${REPLAY_CHECK:-1}" = 1 ]; then
        echo "== the start-up step-cost model against the mixed load's step shapes, timed alone (llama-3-8b)"
        run python3 benchmarks/step_cost_check.py --model "$MODELS/llama-3-8b" --dtype bfloat16
      fi ;;
    batch)
      model llama-3-8b
      echo "== batch tier (llama-3-8b): a 2,000-request batch drains while interactive shorts run"
      run python3 benchmarks/batch_drain.py --model "$MODELS/llama-3-8b" --dtype bfloat16 ;;
    bench)
      model qwen2.5-0.5b
      B=(python3 -m expresslane.cli.main bench)
      echo "== bench one-batch (qwen2.5-0.5b shape)"
      "${B[@]}" one-batch "$MODELS/qwen2.5-0.5b" --batch-size 1 --input-len 128 --output-len 64 \
        --dtype bfloat16 --output "$OUT/bench-one-batch.json" || status=1
      echo "== bench flat-latency (qwen2.5-0.5b shape, with transformers)"
      "${B[@]}" flat-latency "$MODELS/qwen2.5-0.5b" --dtype bfloat16 --baseline hf --disable-tqdm \
        --output "$OUT/bench-flat-latency.json" || status=1
      echo "== bench throughput (qwen2.5-0.5b shape, against transformers)"
      "${B[@]}" throughput "$MODELS/qwen2.5-0.5b" --dtype bfloat16 --num-prompts 256 \
        --output "$OUT/bench-throughput.json" || status=1 ;;
    quant)
      model llama-3-8b
      [ -d "$MODELS/llama-3-8b-awq" ] || python3 -m expresslane.cli.main make-model llama-3-8b \
        "$MODELS/llama-3-8b-awq" --device cuda --quantization awq >/dev/null || status=1
      echo "== quantization kernels on the GPU (FP8/INT4 GEMMs, FP8 KV cache)"
      python3 -m pytest -q tests/test_quant_kernels.py tests/test_kv_fp8.py -p no:cacheprovider 2>&1 \
        | tee -a "$OUT/gpu-tests.log" | tail -3 || status=1
      echo "== quantization: fp8, awq, fp8 KV cache vs bf16 (llama-3-8b)"
      run python3 benchmarks/quant_bench.py --model "$MODELS/llama-3-8b" --awq "$MODELS/llama-3-8b-awq" ${QUANT_ARGS:-} ;;
    gemv)
      echo "== decode GEMVs and quantized linears (8B shapes, random weights)"
      run python3 benchmarks/gemv_bench.py ${GEMV_SWEEP:+--sweep}
      run python3 benchmarks/kv_attention_bench.py ;;
    kernels)
      echo "== attention tiles against the torch reference (every tile of the tables and the sweep)"
      python3 -m pytest -q tests/test_attention_tiles.py -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu-tests.log" \
        | tail -3 || status=1
      echo "== attention at long context: prefill tiles vs SDPA flash / cuDNN, decode splits (8B shape, one layer)"
      run python3 benchmarks/attention_bench.py ${KERNELS_QUICK:+--quick} ;;
    split)
      echo "== attention tiles against the torch reference (split prefill items among them)"
      python3 -m pytest -q tests/test_attention_tiles.py -p no:cacheprovider -k "split" 2>&1 | tee -a "$OUT/gpu-tests.log" \
        | tail -3 || status=1
      echo "== a short prefill chunk after 8k / 32k keys: items whole vs cut over their keys (8B shape, one layer)"
      run python3 benchmarks/split_prefill_bench.py ${SPLIT_TILES:+--tiles} ;;
    longctx)
      model llama-3-8b  # the same weights with Llama-3.1's 128k position limit (Llama-3's is 8k): same cost per token
      L="$MODELS/llama-3-8b-128k"
      [ -d "$L" ] || { mkdir -p "$L" && ln -s "$MODELS/llama-3-8b"/* "$L"/ && rm "$L/config.json" && python3 -c \
        'import json, sys; c = json.load(open(sys.argv[1])); c["max_position_embeddings"] = 131072; json.dump(c, open(sys.argv[2], "w"))' \
        "$MODELS/llama-3-8b/config.json" "$L/config.json"; } || status=1
      echo "== long context through HTTP (llama-3-8b, 33k context, fcfs): TTFT 16k / 32k, ITL at 1k / 16k / 32k"
      LC=(python3 benchmarks/long_context.py --model "$L" --dtype bfloat16 --logs "$OUT")
      run "${LC[@]}" --serve-flags "--scheduling-policy fcfs"
      echo "== the same, our kernel for every prefill chunk (--prefill-attention triton): TTFT 16k / 32k"
      run "${LC[@]}" --lens 16384,32000 --serve-flags "--scheduling-policy fcfs --prefill-attention triton"
      echo "== the same, 8192-token steps (--max-num-batched-tokens 8192): TTFT 16k / 32k"
      run "${LC[@]}" --lens 16384,32000 --serve-flags "--scheduling-policy fcfs --max-num-batched-tokens 8192"
      echo "== prompts of new lengths one after another, in-engine: cuDNN's plan builds (auto), then our kernel"
      for a in auto triton; do run python3 benchmarks/new_lengths.py --model "$L" --prefill-attention $a; done ;;
    tp)
      model llama-3-8b
      echo "== tensor parallel: all-reduce choice, TP=1 vs TP=2 (llama-3-8b)"
      run python3 benchmarks/tp_bench.py --model "$MODELS/llama-3-8b" --tp 2
      echo "== data parallel through the router: DP=1 vs DP=2 (llama-3-8b, through HTTP)"
      run python3 benchmarks/dp_bench.py --model "$MODELS/llama-3-8b" --dp 2 --logs "$OUT" ;;
    moe)
      for m in qwen3-30b-a3b mixtral-8x7b; do  # config + tokenizer only: the engine makes the weights
        [ -d "$MODELS/$m-bare" ] || python3 -m expresslane.cli.main make-model $m "$MODELS/$m-bare" --no-weights \
          >/dev/null || status=1
      done
      Q=(python3 benchmarks/gpu_bench.py --model "$MODELS/qwen3-30b-a3b-bare" --load-format dummy)
      echo "== qwen3-30b-a3b: expresslane"; run "${Q[@]}" --only engine --ttft-lengths 128,8192
      echo "== mixtral-8x7b: expresslane (batch-1 decode)"
      run python3 benchmarks/gpu_bench.py --model "$MODELS/mixtral-8x7b-bare" --load-format dummy --only engine \
        --benches decode
      [ -d "$MODELS/qwen3-30b-a3b-awq-bare" ] || python3 -m expresslane.cli.main make-model qwen3-30b-a3b \
        "$MODELS/qwen3-30b-a3b-awq-bare" --no-weights --quantization awq >/dev/null || status=1
      echo "== qwen3-30b-a3b with AWQ experts (INT4, group 128): expresslane (batch-1 decode)"
      run python3 benchmarks/gpu_bench.py --model "$MODELS/qwen3-30b-a3b-awq-bare" --load-format dummy --only engine \
        --benches decode
      echo "== the fused MoE kernels alone at decode sizes, one layer (qwen3-30b-a3b, mixtral-8x7b), tiles swept at 1 token"
      run python3 benchmarks/moe_kernel_bench.py
      echo "== qwen3-30b-a3b: where a decode step's time goes (kernels by kind, batch 1 and 64)"
      run python3 benchmarks/decode_profile.py --model "$MODELS/qwen3-30b-a3b-bare" --load-format dummy --no-ttft
      echo "== qwen3-30b-a3b: transformers (at most 150 s; what it measured by then stays)"
      timeout 150 "${Q[@]}" --only hf --ttft-lengths 128,8192 --out "$RES" || echo "transformers stopped (rc $?)" ;;
    mxfp4)
      echo "== gpt-oss-20b's MXFP4 experts alone, one layer: each path by token count, tiles swept at 1 and 4 tokens"
      run python3 benchmarks/moe_kernel_bench.py --shapes gpt-oss-20b --tokens 1,4,16,64,128,2048 --sweep-tokens 1,4 ;;
    pdmux)
      for b in 1 32; do
        echo "== prefill beside decode (decode batch $b)"
        python3 benchmarks/pdmux_overlap.py --decode-batch "$b" --out "$OUT/pdmux-b$b.json" 2>&1 \
          | tee "$OUT/pdmux-b$b.log" | tail -30 || status=1
      done ;;
    pdlanes)
      echo "== two lanes on SM partitions: GPU tests"
      python3 -m pytest -q -s tests/test_gpu_lanes.py -p no:cacheprovider 2>&1 | tee "$OUT/pdlanes-tests.log" \
        | grep -e granted -e replayed -e current -e passed -e failed -e Error -e assert | tail -20 || status=1
      model llama-3-8b
      echo "== two lanes beside one lane (llama-3-8b, in-engine)"
      # shellcheck disable=SC2086
      run python3 benchmarks/pd_lanes_bench.py --model "$MODELS/llama-3-8b" --dtype bfloat16 \
        ${PD_CONFIGS:---config default= --config fcfs=scheduling_policy:fcfs --config pd=pd_lanes:on} ;;
    hostile)
      echo "== hostile requests beside two streams (built-in model)"
      run python3 benchmarks/hostile_requests.py
      echo "== n=128, logprobs=20 five times: the API's RSS after each"
      run python3 benchmarks/hostile_requests.py --kind n128lp20 --repeat 5 ;;
    spec)
      PAIR=expresslane/models/data
      echo "== bf16 top-1 agreement of the trained target with transformers, held-out code"
      run python3 benchmarks/bf16_agreement.py --model "$PAIR/stdlib-llama-9m" --held-out-code --num-seqs 64
      echo "== speculative decoding: ngram and draft vs none, batch 1 and 64, held-out code (bf16)"
      run python3 benchmarks/spec_decode_bench.py --dtype bfloat16 --batch-sizes 1,64 --num-prompts 64
      echo "== host time of a step by phase, batch 1, without and with prompt lookup (bf16)"
      run python3 benchmarks/step_phases.py --dtype bfloat16
      echo "== the same, speculating whatever the batch (what it would cost where the cost model says no)"
      run python3 benchmarks/spec_decode_bench.py --dtype bfloat16 --batch-sizes 1,64 --num-prompts 64 \
        --methods none,ngram --speculative-disable-by-batch-size 256 ;;
    *) echo "unknown section: $section" >&2; status=1 ;;
  esac
done

echo "== summary"
python3 benchmarks/summarize.py "$RES"
exit $status
