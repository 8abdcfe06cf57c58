#!/usr/bin/env bash
# Everything that needs a GPU, in one call: install, GPU tests, benchmarks; a table last.
# Usage (device machine, repo root):  bash benchmarks/gpu.sh [--quick]
# Results: JSON lines in ${OUT:-out}/gpu-results.jsonl, logs beside them.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
OUT="${OUT:-out}"; mkdir -p "$OUT"
RES="$OUT/gpu-results.jsonl"; : > "$RES"
MODELS="${MODELS:-/tmp/expresslane-models}"
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"

echo "== GPU tests"
python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -5 || status=1

bench() {  # preset, then extra args for offline_throughput.py
  local preset=$1; shift
  python3 -m expresslane.cli.main make-model "$preset" "$MODELS/$preset" --device cuda >/dev/null || { status=1; return; }
  python3 benchmarks/offline_throughput.py --model "$MODELS/$preset" --device cuda --dtype bfloat16 "$@" \
    2> >(grep -v -e Warning -e '^Loading' >&2) | tee -a "$RES" || status=1
}
echo "== offline throughput (torch attention backend)"
bench qwen2.5-0.5b --num-prompts 64 --input-len 128 --output-len 64
[ "${1:-}" = "--quick" ] || bench llama-3-8b --num-prompts 64 --input-len 128 --output-len 64

echo "== summary"
python3 - "$RES" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'model':<16}{'engine':<14}{'prompts':>8}{'in':>6}{'out':>6}{'seconds':>9}{'tok/s':>10}")
for r in rows:
    print(f"{r['model'].split('/')[-1]:<16}{r['engine']:<14}{r['num_prompts']:>8}{r['input_len']:>6}"
          f"{r['output_len']:>6}{r['seconds']:>9.2f}{r['tokens_per_s']:>10.0f}")
PY
exit $status
