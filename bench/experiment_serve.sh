#!/usr/bin/env bash
# The serving experiment (docs/BENCHMARKS.md, "Serving experiment") on one host with 2 GPUs:
#   mixed:  two mixed replicas (GPU0, GPU1), `disagg-bench serve` round-robins over both;
#   disagg: 1P1D, prefill on GPU0 -> decode on GPU1 over the cuda-ipc transfer backend.
# Qwen3-8B-shaped model with random weights (only config.json), input 4096 / output 256,
# Poisson arrivals at each of $RATES (total req/s). Results: WORK/{mixed,disagg}_rR.json, logs.
#   bench/experiment_serve.sh WORK [mixed|disagg|both]
set -u
WORK=${1:?usage: experiment_serve.sh WORK [mixed|disagg|both]}
WHAT=${2:-both}
RATES=${RATES:-"2 4 8 12"}
SECONDS_PER_RATE=${SECONDS_PER_RATE:-10}
# overrides for a CPU smoke run of this script: DEV0=cpu DEV1=cpu TRANSFER=fabric ...
DEV0=${DEV0:-cuda:0}; DEV1=${DEV1:-cuda:1}; TRANSFER=${TRANSFER:-cuda-ipc}
IN=${IN:-4096}; OUTLEN=${OUTLEN:-256}; DTYPE=${DTYPE:-bfloat16}; VOCAB=${VOCAB:-150000}
MODEL=$WORK/model
mkdir -p "$MODEL"
if [ -n "${CONFIG_JSON:-}" ]; then cp "$CONFIG_JSON" "$MODEL/config.json"; else
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$MODEL/config.json', 'w'))" || exit 1; fi
COMMON=(--model "$MODEL" --random-weights --seed 0 --dtype "$DTYPE" --page-size 16
        --max-model-len 8192 --startup-timeout 400 ${EXTRA:-})
source "$(dirname "$0")/nodes.sh"  # start_node, wait_ready, stop_nodes

sweep() {  # tag connect-args...
  local tag=$1; shift
  local first=1
  for r in $RATES; do
    local n; n=$(python3 -c "print(max(16, int($r * $SECONDS_PER_RATE)))")
    local warm=0; [ $first = 1 ] && warm=2; first=0
    echo "=== $tag rate $r ($n requests)"
    timeout 240 python3 -m disagg.bench serve "$@" --num-prompts "$n" --request-rate "$r" \
      --input-len "$IN" --output-len "$OUTLEN" --vocab-size "$VOCAB" --warmup $warm --timeout 180 \
      --wait 60 --seed "$r" --label "$tag @$r req/s" --json "$WORK/${tag}_r$r.json" \
      || echo "$tag rate $r failed"
  done
}

if [ "$WHAT" = mixed ] || [ "$WHAT" = both ]; then
  start_node mixed0 --role mixed --listen tcp://127.0.0.1:6100 --devices "$DEV0" \
    --max-batch-tokens 2048 "${COMMON[@]}"
  start_node mixed1 --role mixed --listen tcp://127.0.0.1:6101 --devices "$DEV1" \
    --max-batch-tokens 2048 "${COMMON[@]}"
  if wait_ready mixed0 400 && wait_ready mixed1 400; then
    sweep mixed --connect tcp://127.0.0.1:6100 --connect tcp://127.0.0.1:6101
  fi
  stop_nodes
fi

if [ "$WHAT" = disagg ] || [ "$WHAT" = both ]; then
  start_node prefill --role prefill --listen tcp://127.0.0.1:6200 --devices "$DEV0" \
    --transfer-backend "$TRANSFER" --max-batch-tokens 8192 "${COMMON[@]}"
  start_node decode --role decode --listen tcp://127.0.0.1:6201 --devices "$DEV1" \
    --prefill-peer tcp://127.0.0.1:6200 --transfer-backend "$TRANSFER" --prefill-timeout 30 \
    --max-batch-tokens 2048 "${COMMON[@]}"
  if wait_ready prefill 400 && wait_ready decode 400; then
    echo "=== disagg probe"
    if timeout 90 python3 -m disagg.bench serve --connect tcp://127.0.0.1:6201 --num-prompts 2 \
        --input-len "$IN" --output-len 16 --vocab-size "$VOCAB" --timeout 60 --wait 60 \
        --json "$WORK/disagg_probe.json" \
       && python3 -c "import json, sys; s = json.load(open('$WORK/disagg_probe.json'))['summary']; \
sys.exit(0 if s['completed'] == s['num_requests'] else 1)"; then
      sweep disagg --connect tcp://127.0.0.1:6201
    else
      echo "disagg probe failed: cuda-ipc transfers do not work here; (b) not run"
      tail -40 "$WORK/prefill.log" "$WORK/decode.log"
    fi
  fi
  stop_nodes
fi
