#!/usr/bin/env bash
# The serving experiment (docs/BENCHMARKS.md, "Serving experiment") on one host with 2 GPUs:
#   mixed:  two mixed replicas (GPU0, GPU1), `disagg-bench serve` round-robins over both;
#   disagg: 1P1D, prefill on GPU0 -> decode on GPU1 over the cuda-ipc transfer backend.
# Qwen3-8B-shaped model with random weights (only config.json), Poisson arrivals at each rate
# (total req/s), every run scored against goodput SLOs (DistServe: a request is good when its
# TTFT <= SLO_TTFT_MS and its TPOT <= SLO_TPOT_MS; chat-product defaults 1000 ms / 25 ms).
# WORKLOAD is a list, each swept while the nodes are up:
#   fixed     input IN (4096) / output OUTLEN (256) at RATES         -> WORK/{mixed,disagg}_rR.json
#   sharegpt  ShareGPT-like lengths (clip SG_MAX_IN/SG_MAX_OUT) at SHAREGPT_RATES
#                                                          -> WORK/sharegpt_{mixed,disagg}_rR.json
#   multiturn MT_TURNS turns, system MT_SYSTEM, user MT_USER, output MT_OUT, R conversations/s
#             at MULTITURN_RATES                          -> WORK/multiturn_{mixed,disagg}_rR.json
# TAG, when set, prefixes every result name (TAG_mixed_rR.json, TAG_sharegpt_mixed_rR.json).
#   bench/experiment_serve.sh WORK [mixed|disagg|both]
#   WORKLOAD="fixed sharegpt" bench/experiment_serve.sh WORK both
set -u
WORK=${1:?usage: experiment_serve.sh WORK [mixed|disagg|both]}
WHAT=${2:-both}
RATES=${RATES:-"2 4 8 12"}
SHAREGPT_RATES=${SHAREGPT_RATES:-"4 8 16 32"}; MULTITURN_RATES=${MULTITURN_RATES:-"1 2 4"}
WORKLOAD=${WORKLOAD:-fixed}
SECONDS_PER_RATE=${SECONDS_PER_RATE:-10}
SLO_TTFT_MS=${SLO_TTFT_MS:-1000}; SLO_TPOT_MS=${SLO_TPOT_MS:-25}
SG_MAX_IN=${SG_MAX_IN:-4096}; SG_MAX_OUT=${SG_MAX_OUT:-1024}
MT_TURNS=${MT_TURNS:-4}; MT_SYSTEM=${MT_SYSTEM:-2048}; MT_USER=${MT_USER:-256}; MT_OUT=${MT_OUT:-128}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-240}; MIN_PROMPTS=${MIN_PROMPTS:-16}
# overrides for a CPU smoke run of this script: DEV0=cpu DEV1=cpu TRANSFER=fabric ...
DEV0=${DEV0:-cuda:0}; DEV1=${DEV1:-cuda:1}; TRANSFER=${TRANSFER:-cuda-ipc}
IN=${IN:-4096}; OUTLEN=${OUTLEN:-256}; DTYPE=${DTYPE:-bfloat16}; VOCAB=${VOCAB:-150000}
MAXLEN=${MAXLEN:-8192}; PORT=${PORT:-6100}; STARTUP=${STARTUP:-400}
# per-node memory (e.g. NODE_MEM="--num-pages 2048" when both "GPUs" are one device)
NODE_MEM=${NODE_MEM:-}
MODEL=$WORK/model
mkdir -p "$MODEL"
if [ -n "${CONFIG_JSON:-}" ]; then cp "$CONFIG_JSON" "$MODEL/config.json"; else
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$MODEL/config.json', 'w'))" || exit 1; fi
COMMON=(--model "$MODEL" --random-weights --seed 0 --dtype "$DTYPE" --page-size 16
        --max-model-len "$MAXLEN" --startup-timeout "$STARTUP" $NODE_MEM ${EXTRA:-})
source "$(dirname "$0")/nodes.sh"  # start_node, wait_ready, stop_nodes

workload_args() {  # workload -> disagg-bench serve flags
  case $1 in
    fixed) echo "--input-len $IN --output-len $OUTLEN" ;;
    sharegpt) echo "--max-input-len $SG_MAX_IN --max-output-len $SG_MAX_OUT" ;;
    multiturn) echo "--num-turns $MT_TURNS --system-len $MT_SYSTEM --user-len $MT_USER" \
                    "--output-len $MT_OUT" ;;
    *) echo "--input-len $IN --output-len $OUTLEN" ;;
  esac
}
workload_rates() {
  case $1 in sharegpt) echo "$SHAREGPT_RATES" ;; multiturn) echo "$MULTITURN_RATES" ;;
    *) echo "$RATES" ;; esac
}

sweep() {  # system connect-args...: every workload of $WORKLOAD, each at its rates
  local system=$1; shift
  local first=1 wl
  for wl in $WORKLOAD; do
    local prefix=${TAG:-}; [ "$wl" = fixed ] || prefix=${prefix:+${prefix}_}$wl
    local tag=${prefix:+${prefix}_}$system
    local wargs; wargs=$(workload_args "$wl")
    for r in $(workload_rates "$wl"); do
      local n; n=$(python3 -c "print(max($MIN_PROMPTS, int($r * $SECONDS_PER_RATE)))")
      local warm=0; [ $first = 1 ] && warm=2; first=0
      echo "=== $tag ($wl) rate $r ($n requests)"
      # shellcheck disable=SC2086
      timeout "$SERVE_TIMEOUT" python3 -m disagg.bench serve "$@" --workload "$wl" $wargs \
        --num-prompts "$n" --request-rate "$r" --vocab-size "$VOCAB" --warmup $warm \
        --timeout 180 --wait 60 --seed "$r" --slo-ttft-ms "$SLO_TTFT_MS" \
        --slo-tpot-ms "$SLO_TPOT_MS" --label "$tag @$r req/s" --json "$WORK/${tag}_r$r.json" \
        --quiet || echo "$tag rate $r failed"
      python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; g = s['goodput']; \
print(f\"  done {s['completed']}/{s['num_requests']}, TTFT p50 {s['ttft_ms']['p50']:.1f} ms, \
TPOT p50 {s['tpot_ms']['p50']:.2f} ms, meeting both SLOs {g['fraction']:.2f}\")" \
        "$WORK/${tag}_r$r.json" 2>/dev/null || true
    done
  done
}

if [ "$WHAT" = mixed ] || [ "$WHAT" = both ]; then
  start_node mixed0 --role mixed --listen tcp://127.0.0.1:$PORT --devices "$DEV0" \
    --max-batch-tokens 2048 "${COMMON[@]}"
  start_node mixed1 --role mixed --listen tcp://127.0.0.1:$((PORT + 1)) --devices "$DEV1" \
    --max-batch-tokens 2048 "${COMMON[@]}"
  if wait_ready mixed0 "$STARTUP" && wait_ready mixed1 "$STARTUP"; then
    sweep mixed --connect tcp://127.0.0.1:$PORT --connect tcp://127.0.0.1:$((PORT + 1))
  fi
  stop_nodes
fi

if [ "$WHAT" = disagg ] || [ "$WHAT" = both ]; then
  start_node prefill --role prefill --listen tcp://127.0.0.1:$((PORT + 2)) --devices "$DEV0" \
    --transfer-backend "$TRANSFER" --max-batch-tokens 8192 "${COMMON[@]}"
  start_node decode --role decode --listen tcp://127.0.0.1:$((PORT + 3)) --devices "$DEV1" \
    --prefill-peer tcp://127.0.0.1:$((PORT + 2)) --transfer-backend "$TRANSFER" --prefill-timeout 30 \
    --max-batch-tokens 2048 "${COMMON[@]}"
  if wait_ready prefill "$STARTUP" && wait_ready decode "$STARTUP"; then
    echo "=== disagg probe"
    if timeout 90 python3 -m disagg.bench serve --connect tcp://127.0.0.1:$((PORT + 3)) --num-prompts 2 \
        --input-len "$IN" --output-len 16 --vocab-size "$VOCAB" --timeout 60 --wait 60 \
        --json "$WORK/disagg_probe.json" \
       && python3 -c "import json, sys; s = json.load(open('$WORK/disagg_probe.json'))['summary']; \
sys.exit(0 if s['completed'] == s['num_requests'] else 1)"; then
      sweep disagg --connect tcp://127.0.0.1:$((PORT + 3))
    else
      echo "disagg probe failed: cuda-ipc transfers do not work here; (b) not run"
      tail -40 "$WORK/prefill.log" "$WORK/decode.log"
    fi
  fi
  stop_nodes
fi
