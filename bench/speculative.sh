#!/usr/bin/env bash
# Speculative decoding (docs/BENCHMARKS.md, "Speculative decoding"): one mixed node serving the
# embedded SmolLM2-135M (real weights) with --speculative-method ngram, then draft (the model as
# its own draft: every draft accepted, the mechanism's upper bound), then without, on the copy
# workload (a passage, then its start again) at batch 1 and 16.
#   bench/speculative.sh WORK        results: WORK/spec_{ngram,draft,off}_b{1,16}.json, logs
set -u
WORK=${1:?usage: speculative.sh WORK}
DEVICE=${DEVICE:-cuda:0}; DTYPE=${DTYPE:-bfloat16}; K=${K:-4}
INLEN=${INLEN:-512}; OUTLEN=${OUTLEN:-256}; VOCAB=${VOCAB:-49152}
PORT=${PORT:-7788}
mkdir -p "$WORK"
DRAFT=$(python3 -c "from disagg.model.default import default_model_dir as d; print(d(progress=False))")
for mode in ${MODES:-ngram draft off}; do
  flag=()
  [ $mode = ngram ] && flag=(--speculative-method ngram --num-speculative-tokens "$K")
  [ $mode = draft ] && flag=(--speculative-method draft --draft-model "$DRAFT" \
                             --num-speculative-tokens "$K")
  python3 -m disagg --role mixed --listen "tcp://127.0.0.1:$PORT" --devices "$DEVICE" \
    --dtype "$DTYPE" --max-model-len 2048 --startup-timeout 400 "${flag[@]}" ${EXTRA:-} \
    > "$WORK/node_$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 400); do grep -q "ready: " "$WORK/node_$mode.log" && break; sleep 1; done
  for b in 1 16; do
    timeout 600 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:$PORT" \
      --workload copy --num-prompts $((b * 4)) --max-concurrency "$b" --input-len "$INLEN" \
      --output-len "$OUTLEN" --vocab-size "$VOCAB" --seed 0 --warmup 2 --timeout 300 \
      --wait 60 --label "copy $INLEN/$OUTLEN b$b spec $mode" \
      --json "$WORK/spec_${mode}_b$b.json" || echo "bench ($mode, b$b) failed"
  done
  kill -TERM $pid; wait $pid
done
