#!/usr/bin/env bash
# Everything that needs a GPU, in one call: install, GPU tests, benchmarks; a table last.
# Usage (device machine, repo root):  bash benchmarks/gpu.sh [quick|full|8b|lanes]
#   quick: tests + small-model checks;  full (default): + Llama-3-8B and Qwen2.5-7B shapes;
#   8b: tests + the Llama-3-8B shape only (expresslane and transformers);
#   lanes: tests + issue #6's scenario (16 short requests arriving while an 8k prompt and
#   32 batch requests run) under static, continuous-fcfs and continuous-lanes, 8B shape.
# Results: JSON lines in ${OUT:-out}/gpu-results.jsonl, logs beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_VERBOSITY=error
OUT="${OUT:-out}"; mkdir -p "$OUT"
RES="$OUT/gpu-results.jsonl"; : > "$RES"
MODELS="${MODELS:-/tmp/expresslane-models}"
MODE="${1:-full}"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

echo "== GPU tests"
python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 || status=1
if [ "$MODE" != 8b ]; then
  python3 -m pytest -q tests/test_triton_attention.py tests/test_triton_ops.py -p no:cacheprovider 2>&1 \
    | tee -a "$OUT/gpu-tests.log" | tail -3 || status=1
fi

model() {  # build a preset once (weights generated on the GPU)
  python3 -m expresslane.cli.main make-model "$1" "$MODELS/$1" --device cuda >/dev/null || status=1
}
run() {  # a benchmark; its JSON lines go to the results file
  "$@" --out "$RES" 2> >(grep -v -e Warning -e '^Loading' -e 'regex pattern' >&2) || status=1
}

if [ "$MODE" = lanes ]; then
  model llama-3-8b
  echo "== lanes scenario (llama-3-8b)"
  python3 benchmarks/lanes_scenario.py --model "$MODELS/llama-3-8b" --dtype bfloat16 --out "$RES" || status=1
  exit $status
fi
if [ "$MODE" = 8b ]; then
  model llama-3-8b
  echo "== llama-3-8b: expresslane"; run python3 benchmarks/gpu_bench.py --model "$MODELS/llama-3-8b" --only engine
  echo "== llama-3-8b: transformers"; run python3 benchmarks/gpu_bench.py --model "$MODELS/llama-3-8b" --only hf
  echo "== summary"; python3 benchmarks/summarize.py "$RES"; exit $status
fi

model qwen2.5-0.5b
echo "== bf16 agreement (qwen2.5-0.5b shape)"
run python3 benchmarks/bf16_agreement.py --model "$MODELS/qwen2.5-0.5b"
echo "== step profile (qwen2.5-0.5b shape)"
python3 benchmarks/step_profile.py --model "$MODELS/qwen2.5-0.5b" --out "$RES" 2>&1 | tee "$OUT/step-profile.txt" | head -45
echo "== engine benchmarks (qwen2.5-0.5b shape)"
run python3 benchmarks/gpu_bench.py --model "$MODELS/qwen2.5-0.5b" --only engine
if [ "$MODE" = full ]; then
  for m in llama-3-8b qwen2.5-7b; do
    model $m
    echo "== $m: expresslane"; run python3 benchmarks/gpu_bench.py --model "$MODELS/$m" --only engine
    echo "== $m: transformers"; run python3 benchmarks/gpu_bench.py --model "$MODELS/$m" --only hf
  done
fi

echo "== summary"
python3 benchmarks/summarize.py "$RES"
exit $status
