#!/usr/bin/env bash
# Prefix caching across the split (docs/BENCHMARKS.md, "Prefix caching"): a prefill and a
# decode node on one GPU (cuda-ipc), the multiturn workload against the decoder, with the
# caches on, then off. Results: WORK/split_{on,off}.json, node logs.
#   bench/multiturn_split.sh WORK     (same knobs as bench/multiturn.sh, plus PAGES)
set -u
WORK=${1:?usage: multiturn_split.sh WORK}
DEVICE=${DEVICE:-cuda:0}; DTYPE=${DTYPE:-bfloat16}; VOCAB=${VOCAB:-150000}
CONVS=${CONVS:-32}; TURNS=${TURNS:-4}; SYSTEM=${SYSTEM:-2048}; USER=${USER_LEN:-256}
OUTLEN=${OUTLEN:-128}; RATE=${RATE:-4}; PAGES=${PAGES:-8000}
mkdir -p "$WORK/model"
python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$WORK/model/config.json', 'w'))" || exit 1
COMMON=(--model "$WORK/model" --random-weights --seed 0 --dtype "$DTYPE" --page-size 16
        --max-model-len 8192 --startup-timeout 400 --devices "$DEVICE" --num-pages "$PAGES"
        --transfer-backend cuda-ipc)
wait_ready() { for _ in $(seq 1 400); do grep -q "ready: " "$1" && return 0; sleep 1; done; return 1; }
for mode in on off; do
  flag=(); [ $mode = off ] && flag=(--no-prefix-caching)
  python3 -m disagg --role prefill --listen tcp://127.0.0.1:7801 "${COMMON[@]}" "${flag[@]}" \
    > "$WORK/prefill_$mode.log" 2>&1 &
  p=$!
  wait_ready "$WORK/prefill_$mode.log" || { tail -20 "$WORK/prefill_$mode.log"; exit 1; }
  python3 -m disagg --role decode --listen tcp://127.0.0.1:7802 \
    --prefill-peer tcp://127.0.0.1:7801 "${COMMON[@]}" "${flag[@]}" \
    > "$WORK/decode_$mode.log" 2>&1 &
  d=$!
  wait_ready "$WORK/decode_$mode.log" || { tail -20 "$WORK/decode_$mode.log"; exit 1; }
  sleep 2  # the decoder's first pongs
  timeout 600 python3 -m disagg.bench serve --connect tcp://127.0.0.1:7802 \
    --workload multiturn --num-prompts "$CONVS" --num-turns "$TURNS" --system-len "$SYSTEM" \
    --user-len "$USER" --output-len "$OUTLEN" --request-rate "$RATE" --vocab-size "$VOCAB" \
    --seed 0 --warmup 2 --timeout 300 --wait 60 --label "split multiturn cache $mode" \
    --json "$WORK/split_$mode.json" || echo "bench ($mode) failed"
  python3 -c "import sys; from disagg.cli.client import main; \
sys.argv = ['disagg-client', '--connect', 'tcp://127.0.0.1:7801', '--stats']; main()" \
    > "$WORK/prefill_stats_$mode.json" 2>&1 || true
  kill -TERM $d $p; wait $d $p
done
