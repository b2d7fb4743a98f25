#!/usr/bin/env bash
# Overlapped decoding on a mixed node (#18; docs/BENCHMARKS.md "One-GPU speed"): the same
# Qwen3-8B-shaped node (random bf16 weights, config.json only, CUDA graphs) with
# --overlap-schedule on and off, both started at once on one GPU, each measured alone with
# `disagg-bench serve` at batch 1 (one request at a time) and batch 64 (64 concurrent).
# Results: WORK/{on,off}_b{1,64}.json and the node logs.
#   bench/overlap_serve.sh WORK      (MODES="on" starts only the overlapped node; EXTRA adds node flags)
set -u
WORK=${1:?usage: overlap_serve.sh WORK}
DEV=${DEV:-cuda:0}; IN=${IN:-128}; OUTLEN=${OUTLEN:-256}; VOCAB=${VOCAB:-150000}
MODEL=$WORK/model
mkdir -p "$MODEL"
if [ -n "${CONFIG_JSON:-}" ]; then cp "$CONFIG_JSON" "$MODEL/config.json"; else
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$MODEL/config.json', 'w'))" || exit 1; fi
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait' EXIT
port=$((7300 + RANDOM % 300))
for mode in ${MODES:-on off}; do
  python3 -m disagg --role mixed --model "$MODEL" --random-weights --seed 0 --devices "$DEV" \
    --dtype "${DTYPE:-bfloat16}" --page-size 16 --max-model-len 2048 --max-running 64 \
    --num-pages "${PAGES:-4096}" --overlap-schedule $mode --startup-timeout 400 \
    --listen "tcp://127.0.0.1:$((port + ${#PIDS[@]}))" ${EXTRA:-} > "$WORK/$mode.log" 2>&1 &
  PIDS+=($!)
done
for mode in ${MODES:-on off}; do
  for _ in $(seq 1 300); do grep -q "ready: " "$WORK/$mode.log" && break; sleep 1; done
  grep "ready: " "$WORK/$mode.log" || { tail -30 "$WORK/$mode.log"; exit 1; }
done
i=0
for mode in ${MODES:-on off}; do
  for b in 1 64; do
    n=$((b == 1 ? ${N1:-4} : 2 * b))
    timeout 300 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:$((port + i))" \
      --num-prompts "$n" --max-concurrency "$b" --input-len "$IN" --output-len "$OUTLEN" \
      --vocab-size "$VOCAB" --seed 0 --warmup 2 --timeout 240 --label "overlap $mode, batch $b" \
      --json "$WORK/${mode}_b$b.json" || echo "overlap $mode batch $b failed"
  done
  i=$((i + 1))
done
i=0
for mode in ${MODES:-on off}; do
  echo "$mode: late compiles $(grep -c 'Triton compiled' "$WORK/$mode.log")"
  python3 -c "import sys; from disagg.cli.client import main; main(sys.argv[1:])" --connect "tcp://127.0.0.1:$((port + i))" --stats --json \
    > "$WORK/${mode}_stats.json" 2>&1
  grep -o '"steps_overlapped": *[0-9]*' "$WORK/${mode}_stats.json"
  i=$((i + 1))
done
