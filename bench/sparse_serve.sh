#!/usr/bin/env bash
# A short serving run of each MoE/MLA shape on one mixed node (#16; docs/BENCHMARKS.md):
# random bf16 weights (config.json only, bench/sparse_engine.py's shapes), CUDA graphs on,
# `disagg-bench serve` at a fixed concurrency. Results: WORK/serve_SHAPE.json and logs.
#   bench/sparse_serve.sh WORK [v2lite qwen3moe]
set -u
WORK=${1:?usage: sparse_serve.sh WORK [SHAPE...]}
shift
SHAPES=${*:-v2lite qwen3moe}
IN=${IN:-1024}; OUTLEN=${OUTLEN:-128}; CONC=${CONC:-16}; N=${N:-48}
mkdir -p "$WORK"
for shape in $SHAPES; do
  mkdir -p "$WORK/$shape"
  python3 -c "import json, sys; sys.path.insert(0, 'bench'); from sparse_engine import SHAPES; \
json.dump(SHAPES['$shape'], open('$WORK/$shape/config.json', 'w'))" || exit 1
  vocab=$(python3 -c "import json; print(json.load(open('$WORK/$shape/config.json'))['vocab_size'])")
  port=$((7700 + RANDOM % 200))
  python3 -m disagg --role mixed --model "$WORK/$shape" --random-weights --seed 0 \
    --devices "${DEV:-cuda:0}" \
    --dtype bfloat16 --page-size 16 --max-model-len 4096 --listen "tcp://127.0.0.1:$port" \
    --startup-timeout 400 > "$WORK/$shape.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    grep -q "ready: " "$WORK/$shape.log" && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  grep "ready: " "$WORK/$shape.log" || { tail -30 "$WORK/$shape.log"; kill $pid; continue; }
  timeout 300 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:$port" \
    --num-prompts "$N" --max-concurrency "$CONC" --input-len "$IN" --output-len "$OUTLEN" \
    --vocab-size "$vocab" --seed 0 --warmup 2 --timeout 240 --label "$shape mixed" \
    --json "$WORK/serve_$shape.json" || echo "$shape serve failed"
  kill -TERM $pid; wait $pid 2>/dev/null
  grep -c "Triton compiled" "$WORK/$shape.log" | sed "s/^/$shape late compiles: /"
done
