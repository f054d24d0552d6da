#!/usr/bin/env bash
# Cross-check `splitserve bench` against guidellm (unmodified) on one endpoint and one workload shape:
# 128-token prompts, 64 output tokens, 4 concurrent streams, 40 requests, greedy.
# Usage: benchmarks/guidellm/crosscheck.sh [OUT_DIR]   (needs `pip install guidellm`; starts and stops its own cluster)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench-out/crosscheck-$(date +%Y%m%d-%H%M%S)}
PY=${PY:-.venv/bin/python}
GUIDELLM=(${GUIDELLM:-"$PY" -m guidellm})
MODEL=synthetic:llama-25m
PORT=${PORT:-18080}
mkdir -p "$OUT"
UCX_NET_DEVICES=lo PD_LOG_LEVEL=WARNING "$PY" -m splitserve.cli up --model "$MODEL" --http-port "$PORT" --grpc-port $((PORT + 1)) \
  > "$OUT/cluster.log" 2>&1 &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
URL=http://127.0.0.1:$PORT
# warm-up, not measured
"$PY" -m splitserve.cli bench --url "$URL" --model "$MODEL" --workload fixed --prompt-tokens 128 --output-tokens 8 \
  --num-requests 4 --arrival concurrency --concurrency 4 --no-progress --out "$OUT/warmup" > /dev/null
"$PY" -m splitserve.cli bench --url "$URL" --model "$MODEL" --workload fixed --prompt-tokens 128 --output-tokens 64 \
  --num-requests 40 --arrival concurrency --concurrency 4 --no-progress --label splitserve-bench --out "$OUT/splitserve" \
  | tee "$OUT/splitserve.txt"
"${GUIDELLM[@]}" run -c benchmarks/guidellm/fixed-128-64.json \
  --backend "kind=openai_http,target=$URL,model=$MODEL,request_format=/v1/completions" \
  --tokenizer kind=huggingface_auto,model=models/TinyStories-656K \
  --output "kind=json,path=$OUT/guidellm.json" --disable-console-interactive 2>&1 | tee "$OUT/guidellm.txt"
"$PY" -m splitserve.cli bench --url "$URL" --model "$MODEL" --workload fixed --prompt-tokens 128 --output-tokens 64 \
  --num-requests 40 --arrival concurrency --concurrency 4 --no-progress --label splitserve-bench-again --out "$OUT/splitserve-again" \
  | tee "$OUT/splitserve-again.txt"

"$PY" benchmarks/guidellm/compare.py "$OUT/guidellm.json" "$OUT/splitserve/results.json" "$OUT/splitserve-again/results.json" \
  | tee "$OUT/comparison.md"
echo "outputs in $OUT"
