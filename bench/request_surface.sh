#!/usr/bin/env bash
# The OpenAI request surface on one GPU (#34; docs/BENCHMARKS.md "The request surface"): a
# Qwen3-8B-shaped mixed node (random bf16 weights, CUDA graphs, overlapped decoding) with a
# real tokenizer (MODEL_DIR: config.json + tokenizer.json; the grammar needs the vocabulary),
# measured in one run with `disagg-bench serve`:
#   batch 64, plain / every request JSON-schema constrained (bench/data/surface_schema.json,
#   which no output finishes within OUTLEN tokens) / top_logprobs=5 on every request / sampled
#   (temperature 0.8, top-p 0.95; KINDS="plain json logprobs sampled" picks them): TPOT;
#   a 2k prompt, n=1 and n=8 through the gateway, one request at a time: TTFT, and the
#   node's prefix counters (one prefill per request: the other choices hit its pages). These
#   ask logprobs 0 (the sampled token's): the gateway sends no event for a token whose text
#   is empty (the model's ids past the tokenizer's 49,152 have none), so without them the
#   "first token" the client saw was the first with text, for n=8 often one after the other
#   choices' prefill step.
#   bench/request_surface.sh WORK MODEL_DIR      (results: WORK/*.json, WORK/node.log)
set -u
WORK=${1:?usage: request_surface.sh WORK MODEL_DIR}; MODEL=${2:?model dir}
DEV=${DEV:-cuda:0}; OUTLEN=${OUTLEN:-256}; VOCAB=${VOCAB:-49152}
mkdir -p "$WORK"
port=$((7600 + RANDOM % 300)); hport=$((port + 1))
python3 -m disagg --role mixed --model "$MODEL" --random-weights --seed 0 --devices "$DEV" \
  --dtype bfloat16 --page-size 16 --max-model-len 4096 --max-running 64 \
  --num-pages "${PAGES:-8192}" --overlap-schedule on --startup-timeout 400 \
  --listen "tcp://127.0.0.1:$port" --http-listen "127.0.0.1:$hport" ${EXTRA:-} \
  > "$WORK/node.log" 2>&1 &
NODE=$!
trap 'kill -TERM $NODE 2>/dev/null; wait' EXIT
for _ in $(seq 1 400); do grep -q "ready: " "$WORK/node.log" && break; sleep 1; done
grep "ready: " "$WORK/node.log" || { tail -30 "$WORK/node.log"; exit 1; }
stats() { python3 -c "import sys; from disagg.cli.client import main; main(sys.argv[1:])" \
  --connect "tcp://127.0.0.1:$port" --stats --json > "$WORK/$1.json" 2>&1; }
b64() {  # name, extra flags
  local name=$1; shift
  timeout 400 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:$port" \
    --num-prompts "${NUM:-128}" --max-concurrency 64 --input-len 128 --output-len "$OUTLEN" \
    --vocab-size "$VOCAB" --seed 0 --warmup 2 --timeout 300 --label "batch 64, $name" \
    --json "$WORK/b64_$name.json" "$@" || echo "batch 64 $name failed"
}
kinds=${KINDS:-plain json logprobs}; [ -n "${NO_LOGPROBS:-}" ] && kinds=${kinds/logprobs/}
# one unmeasured batch-64 run first (WARM_RUN=0: none): in every H100 node run of 2026-12-07
# the first plain run was slower than the plain run of the next round (7.55-7.80 against
# 7.28-7.51 ms TPOT) while the other kinds held still, which made round 1's ratios look better
[ "${WARM_RUN:-1}" = 0 ] || b64 "warm"
for round in ${ROUNDS:-1 2}; do  # two rounds, interleaved, so a drift shows
  for kind in $kinds; do
    case $kind in
      plain) b64 "plain_r$round" ;;
      json) b64 "json_r$round" --json-schema @bench/data/surface_schema.json ;;
      logprobs) b64 "logprobs_r$round" --top-logprobs 5 ;;
      sampled) b64 "sampled_r$round" --temperature 0.8 --top-p 0.95 ;;
      *) echo "unknown kind $kind" ;;
    esac
  done
done
i=0
for n in ${NS-1 8 1 8}; do
  i=$((i + 1)); [ "$i" -gt 2 ] && n="${n}_r2" || n="${n}_r1"
  stats "stats_before_n$n"
  timeout 300 python3 -m disagg.bench serve --http "http://127.0.0.1:$hport" --n "${n%_*}" \
    --num-prompts "${NUM2K:-8}" --max-concurrency 1 --input-len "${LONG:-2048}" --output-len 16 --vocab-size "$VOCAB" \
    --seed "$((10 + i))" --warmup 1 --timeout 200 --label "2k prompt, n=$n" --top-logprobs 0 \
    --json "$WORK/n$n.json" || echo "n=$n failed"
  stats "stats_after_n$n"
done
echo "late compiles: $(grep -c 'Triton compiled' "$WORK/node.log")"
python3 - "$WORK" <<'PY'
import json, sys, pathlib
w = pathlib.Path(sys.argv[1])
def s(name):
    p = w / f"{name}.json"
    return json.loads(p.read_text())["summary"] if p.exists() else None
for r in range(1, 10):  # the rounds run (ROUNDS)
    base = s(f"b64_plain_r{r}")
    for k in ("plain", "json", "logprobs", "sampled"):
        x = s(f"b64_{k}_r{r}")
        if x and base:
            print(f"round {r} {k:9s} TPOT p50 {x['tpot_ms']['p50']:.2f} ms mean "
                  f"{x['tpot_ms']['mean']:.2f} ({x['tpot_ms']['p50'] / base['tpot_ms']['p50']:.3f}x)"
                  f" completed {x['completed']} tokens {x['total_output_tokens']}")
for n in ("1_r1", "8_r1", "1_r2", "8_r2"):
    x = s(f"n{n}")
    if x:
        print(f"n={n}: TTFT p50 {x['ttft_ms']['p50']:.1f} ms mean {x['ttft_ms']['mean']:.1f}")
    if not (w / f"stats_before_n{n}.json").exists():
        continue
    b = json.loads((w / f"stats_before_n{n}.json").read_text())
    a = json.loads((w / f"stats_after_n{n}.json").read_text())
    print(f"  prefix query {a['prefix_query_tokens'] - b['prefix_query_tokens']} hit "
          f"{a['prefix_hit_tokens'] - b['prefix_hit_tokens']}")
PY
