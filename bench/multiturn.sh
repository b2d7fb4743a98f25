#!/usr/bin/env bash
# Prefix caching on the multiturn workload (docs/BENCHMARKS.md, "Prefix caching"): one mixed
# node with the cache on, then off, the same seeded conversations against each.
#   bench/multiturn.sh WORK          results: WORK/multiturn_{on,off}.json, node logs
# Defaults are for one GPU with a Qwen3-8B-shaped model (random bf16 weights); a CPU run:
#   DEVICE=cpu DTYPE=float32 MODEL_DIR=<dir> CONVS=8 SYSTEM=256 USER=64 OUTLEN=16 ...
set -u
WORK=${1:?usage: multiturn.sh WORK}
DEVICE=${DEVICE:-cuda:0}; DTYPE=${DTYPE:-bfloat16}; VOCAB=${VOCAB:-150000}
CONVS=${CONVS:-32}; TURNS=${TURNS:-4}; SYSTEM=${SYSTEM:-2048}; USER=${USER_LEN:-256}
OUTLEN=${OUTLEN:-128}; RATE=${RATE:-4}
mkdir -p "$WORK"
if [ -z "${MODEL_DIR:-}" ]; then
  MODEL_DIR=$WORK/model; mkdir -p "$MODEL_DIR"
  python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$MODEL_DIR/config.json', 'w'))" || exit 1
  RANDOM_WEIGHTS=(--random-weights --seed 0)
else
  RANDOM_WEIGHTS=()
fi
PORT=${PORT:-7777}
for mode in on off; do
  flag=(); [ $mode = off ] && flag=(--no-prefix-caching)
  python3 -m disagg --role mixed --listen "tcp://127.0.0.1:$PORT" --devices "$DEVICE" \
    --model "$MODEL_DIR" "${RANDOM_WEIGHTS[@]}" --dtype "$DTYPE" --page-size 16 \
    --max-model-len 8192 --startup-timeout 400 "${flag[@]}" ${EXTRA:-} \
    > "$WORK/node_$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 400); do grep -q "ready: " "$WORK/node_$mode.log" && break; sleep 1; done
  timeout 600 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:$PORT" \
    --workload multiturn --num-prompts "$CONVS" --num-turns "$TURNS" --system-len "$SYSTEM" \
    --user-len "$USER" --output-len "$OUTLEN" --request-rate "$RATE" --vocab-size "$VOCAB" \
    --seed 0 --warmup 2 --timeout 300 --wait 60 --label "multiturn cache $mode" \
    --json "$WORK/multiturn_$mode.json" || echo "bench ($mode) failed"
  kill -TERM $pid; wait $pid
done
