#!/usr/bin/env bash
# TTFT breakdown on one GPU (issue 18, items 6 and 8): a prefill and a decode node on the same
# device (cuda-ipc) and a mixed node beside them, random bf16 weights of a Qwen3-8B-shaped
# config.json. Measures, at light load (one request at a time):
#   first   - the very first request of the prefill/decode pair after start-up (first transfer)
#   split_L - the split path for each of LONG_LENS (exposed transfer P50, prefill queue/compute)
#   short_L - the split path for each of SHORT_LENS (a prefill node on short prompts)
#   mixed_L - the mixed node alone for each of LONG_LENS and SHORT_LENS (the same prompts as
#             split_L / short_L: the side-by-side, split TTFT minus mixed TTFT per length)
# The prefix cache is off (CACHE=on keeps it); warm-up prompts are never measured ones.
# exposed_transfer (#39): TTFT less the prefiller's compute (to its last layer on the device)
# and the decoder's first step, with its parts (request_trip, prefill_queue, transfer_tail,
# completion_signal, wake_up; docs/BENCHMARKS.md).
# Results: WORK/*.json (disagg-bench serve), WORK/summary.json and WORK/summary.txt, node logs.
#   bench/ttft_tail.sh WORK
# Two GPUs: DECODE_DEVICE=cuda:1 puts the decode node there (prefill and mixed stay on DEVICE),
# so the split's KV crosses GPU0 -> GPU1 (the exposed-transfer sweep of issue 19).
# Overrides (CPU dry run: DEVICE=cpu TRANSFER=fabric DTYPE=float32 CONFIG_JSON=tiny.json
#   LONG_LENS="64 128" SHORT_LENS="17 30" PAGE=4 ...):
#   DEVICE DECODE_DEVICE DTYPE TRANSFER CONFIG_JSON LONG_LENS SHORT_LENS N_LONG N_SHORT OUTLEN
#   PAGES MAXLEN PAGE VOCAB PORT STARTUP EXTRA (extra node flags) DECODE_EXTRA (the decode
#   node's only, e.g. "--local-prefill-max-tokens 256")
# TRACE=1: the prefill and decode nodes record hop marks (disagg.trace) into WORK/trace, and
#   bench/tail_trace.py breaks the split runs' time down hop by hop (WORK/tail_trace.{txt,json}).
set -u
WORK=${1:?usage: ttft_tail.sh WORK}
DEVICE=${DEVICE:-cuda:0}; DECODE_DEVICE=${DECODE_DEVICE:-$DEVICE}
DTYPE=${DTYPE:-bfloat16}; TRANSFER=${TRANSFER:-cuda-ipc}
LONG_LENS=${LONG_LENS:-"1024 4096 16384 32768"}; SHORT_LENS=${SHORT_LENS:-"17 64 130"}
N_LONG=${N_LONG:-8}; N_SHORT=${N_SHORT:-16}; OUTLEN=${OUTLEN:-4}
PAGES=${PAGES:-4608}; MAXLEN=${MAXLEN:-33792}; PAGE=${PAGE:-16}; VOCAB=${VOCAB:-150000}
PORT=${PORT:-7811}; STARTUP=${STARTUP:-300}
PY=${PYTHON:-python3}
MODEL=$WORK/model
mkdir -p "$MODEL"
if [ -n "${CONFIG_JSON:-}" ]; then cp "$CONFIG_JSON" "$MODEL/config.json"; else
$PY -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$MODEL/config.json', 'w'))" || exit 1; fi
COMMON=(--model "$MODEL" --random-weights --seed 0 --dtype "$DTYPE" --page-size "$PAGE"
        --max-model-len "$MAXLEN" --num-pages "$PAGES" --startup-timeout "$STARTUP" ${EXTRA:-})
[ "${CACHE:-off}" = on ] || COMMON+=(--no-prefix-caching)
P=tcp://127.0.0.1:$PORT; D=tcp://127.0.0.1:$((PORT + 1)); M=tcp://127.0.0.1:$((PORT + 2))
NODE_TIMEOUT=$((STARTUP + 600))
source "$(dirname "$0")/nodes.sh"  # start_node, wait_ready, stop_nodes

serve() {  # tag connect input-len n warmup
  local tag=$1 addr=$2 len=$3 n=$4 warm=$5
  echo "=== $tag: input $len, $n requests one at a time (warmup $warm)"
  timeout 300 $PY -m disagg.bench serve --connect "$addr" --num-prompts "$n" \
    --max-concurrency 1 --request-rate inf --input-len "$len" --output-len "$OUTLEN" \
    --vocab-size "$VOCAB" --warmup "$warm" --timeout 120 --wait 60 --seed "$len" \
    --label "$tag" --json "$WORK/$tag.json" --quiet || echo "$tag failed (rc $?)"
}

T0=$(date +%s)
# all three start at once (start-up dominates the run); the mixed node idles meanwhile
echo "prefill and mixed on $DEVICE, decode on $DECODE_DEVICE ($TRANSFER)"
[ -n "${TRACE:-}" ] && export DISAGG_TRACE=$WORK/trace
start_node prefill --role prefill --listen "$P" --transfer-backend "$TRANSFER" \
  --devices "$DEVICE" "${COMMON[@]}"
start_node decode --role decode --listen "$D" --prefill-peer "$P" --transfer-backend "$TRANSFER" \
  --devices "$DECODE_DEVICE" "${COMMON[@]}" ${DECODE_EXTRA:-}
unset DISAGG_TRACE
start_node mixed --role mixed --listen "$M" --devices "$DEVICE" "${COMMON[@]}"
wait_ready prefill "$STARTUP" && wait_ready decode "$STARTUP" && wait_ready mixed "$STARTUP" \
  || exit 1
echo "nodes ready after $(( $(date +%s) - T0 )) s"
# the decoder must see the prefiller alive, or it prefills locally
timeout 60 $PY - "$D" <<'EOF' || { echo "decoder never saw the prefiller"; exit 1; }
import sys, time
from disagg.client import Client
c = Client(sys.argv[1])
deadline = time.monotonic() + 55
while time.monotonic() < deadline:
    if c.stats(timeout=10).prefill_peers_alive >= 1:
        sys.exit(0)
    time.sleep(0.2)
sys.exit(1)
EOF
first=${LONG_LENS%% *}
serve first "$D" "$first" 1 0  # the pair's first transfer: nothing before it
for L in $LONG_LENS; do serve "split_$L" "$D" "$L" "$N_LONG" 2; done
for L in $SHORT_LENS; do serve "short_$L" "$D" "$L" "$N_SHORT" 2; done
for L in $LONG_LENS; do serve "mixed_$L" "$M" "$L" "$N_LONG" 2; done
for L in $SHORT_LENS; do serve "mixed_$L" "$M" "$L" "$N_SHORT" 2; done
for n in prefill:0 decode:1 mixed:2; do
  timeout 30 $PY -c "import sys; from disagg.cli.client import main; main(sys.argv[1:])" \
    --connect "tcp://127.0.0.1:$((PORT + ${n#*:}))" --stats > "$WORK/stats_${n%:*}.json" 2>&1 || true
done
stop_nodes
timeout 60 $PY - "$WORK" <<'EOF'
import glob, json, os, sys
work = sys.argv[1]
out, lines = {}, []
fields = ("prefill_compute", "first_step", "exposed_transfer", "decode_queue", "request_trip",
          "prefill_queue", "transfer_tail", "completion_signal", "wake_up")
lines.append(f"{'run':<14}{'n':>4}{'ttft p50':>10}{'ttft p90':>10}" +
             "".join(f"{f[:12]:>14}" for f in fields) + "   (ms, p50)")
def key(p):
    tag = os.path.basename(p)[:-5]
    kind, _, n = tag.partition("_")
    return ({"first": 0, "split": 1, "short": 2, "mixed": 3}.get(kind, 4),
            int(n) if n.isdigit() else 0, tag)
for path in sorted(glob.glob(os.path.join(work, "*.json")), key=key):
    tag = os.path.basename(path)[:-5]
    if tag.startswith(("summary", "stats_")):
        continue
    try:
        s = json.load(open(path))["summary"]
    except Exception as e:  # noqa: BLE001
        lines.append(f"{tag:<14} unreadable: {e}")
        continue
    b = s.get("ttft_breakdown_ms") or {}
    row = {"completed": s.get("completed"), "failed": s.get("failed"),
           "ttft_p50_ms": s["ttft_ms"].get("p50"), "ttft_p90_ms": s["ttft_ms"].get("p90"),
           "breakdown_p50_ms": {k: v.get("p50") for k, v in b.items()},
           "breakdown_p90_ms": {k: v.get("p90") for k, v in b.items()}}
    out[tag] = row
    f = lambda x: f"{x:>10.2f}" if isinstance(x, (int, float)) else f"{'-':>10}"
    g = lambda x: f"{x:>14.2f}" if isinstance(x, (int, float)) else f"{'-':>14}"
    lines.append(f"{tag:<14}{row['completed'] or 0:>4}{f(row['ttft_p50_ms'])}"
                 f"{f(row['ttft_p90_ms'])}" + "".join(g(row["breakdown_p50_ms"].get(k))
                                                      for k in fields))
lines.append("split minus mixed, same prompts (TTFT p50, ms):")
for tag in sorted(out, key=lambda t: key(t + ".json")):
    kind, _, n = tag.partition("_")
    twin = out.get(f"mixed_{n}")
    if kind in ("split", "short") and twin and out[tag]["ttft_p50_ms"] is not None \
            and twin["ttft_p50_ms"] is not None:
        d = out[tag]["ttft_p50_ms"] - twin["ttft_p50_ms"]
        out[tag]["minus_mixed_p50_ms"] = d
        lines.append(f"  {n:>6}: {out[tag]['ttft_p50_ms']:.2f} - {twin['ttft_p50_ms']:.2f} = {d:.2f}")
json.dump(out, open(os.path.join(work, "summary.json"), "w"), indent=1)
text = "\n".join(lines)
open(os.path.join(work, "summary.txt"), "w").write(text + "\n")
print(text)
EOF
if [ -n "${TRACE:-}" ]; then
  $PY "$(dirname "$0")/tail_trace.py" "$WORK/trace" --json "$WORK/tail_trace.json" \
    > "$WORK/tail_trace.txt" 2>&1; cat "$WORK/tail_trace.txt"
fi
echo "total $(( $(date +%s) - T0 )) s"
