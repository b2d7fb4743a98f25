#!/usr/bin/env bash
# KV tiers on one GPU (issue 38, "Measured"; docs/BENCHMARKS.md): a mixed node serving a
# Qwen3-8B-shaped model (random bf16 weights, config.json only) with a device page pool of
# PAGES pages of 16 tokens (default 2560: 40k tokens, 6 GB), about a quarter of what the
# multiturn conversations' KV needs (CONVS=64 conversations x TURNS=8 turns: a 1024-token
# system prompt shared by all, 256 new user tokens and 64 answer tokens a turn, so ~165k
# distinct tokens, ~24 GB), with CONC=8 conversations in flight. Run twice, one node at a
# time: device-only (the prefix cache alone) and with a host tier of HOST_MB MiB (default 32768,
# pinned: it holds every conversation). Then, on the host-tier node, a 4k-token prefix hit from
# the device against one from the host tier (bench/kv_tiers_hit.py); and the TPOT of STEADY
# other requests while the tiers copy (bench/kv_tiers_tpot.py: reloads of host hits against
# device hits on the host-tier node, copies out of fresh prompts against the device-only node).
# MODES (default "device host") may add "roomy": device-only with ROOMY_PAGES pages (default
# 12800, 200k tokens: every conversation fits), the floor a perfect tier could reach.
#   bash bench/kv_tiers.sh [WORK]      (default WORK=/tmp/kv_tiers; results WORK/*.json, logs)
# Prints: TTFT p50 of the later turns (turns 1..7) device-only vs host tier and their ratio
# (issue: <= 0.4), TPOT p50 of both runs, the 4k host hit over the device hit (<= 1.3x), and
# the steady requests' TPOT while reloading / copying out over without (<= 1.05x). Env: DEVICE, DTYPE, PAGES, HOST_MB, CONVS, TURNS, SYSTEM, USER_LEN, OUTLEN, CONC,
# PREFIX, STEADY, STEADY_OUT, TPOT_PREFIXES, TPOT (0: no steady-TPOT windows), MODEL_DIR (a real model directory instead of random weights), EXTRA (node flags).
# On a lent H200 (no package registry): carry [".whl"] (msgspec, pyzmq wheels; docs GPU.md);
# they are installed into /tmp/site when missing. A CPU dry run of the whole script:
#   DEVICE=cpu DTYPE=float32 MODEL_DIR=<tiny model> VOCAB=300 PAGES=64 HOST_MB=64 CONVS=6
#   TURNS=3 SYSTEM=32 USER_LEN=16 OUTLEN=4 CONC=2 PREFIX=128 EXTRA="--threads 1" bash ...
set -u
WORK=${1:-/tmp/kv_tiers}
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(dirname "$HERE"); cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1
source "$ROOT/bench/device_env.sh"
device_env "$ROOT" || echo "setup: wheel install failed"
DEVICE=${DEVICE:-cuda:0}; DTYPE=${DTYPE:-bfloat16}; VOCAB=${VOCAB:-150000}
PAGES=${PAGES:-2560}; HOST_MB=${HOST_MB:-32768}; ROOMY_PAGES=${ROOMY_PAGES:-12800}
CONVS=${CONVS:-64}; TURNS=${TURNS:-8}; SYSTEM=${SYSTEM:-1024}; USER_LEN=${USER_LEN:-256}
OUTLEN=${OUTLEN:-64}; CONC=${CONC:-8}; PREFIX=${PREFIX:-4096}
STEADY=${STEADY:-16}; STEADY_OUT=${STEADY_OUT:-2048}; TPOT_PREFIXES=${TPOT_PREFIXES:-8}
PORT=${PORT:-7791}
mkdir -p "$WORK"
if [ -z "${MODEL_DIR:-}" ]; then
  MODEL_DIR=$WORK/model; mkdir -p "$MODEL_DIR"
  python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open('$MODEL_DIR/config.json', 'w'))" || exit 1
  WEIGHTS=(--random-weights --seed 0)
else
  WEIGHTS=()
fi
PID=
trap '[ -n "$PID" ] && kill -TERM "$PID" 2>/dev/null; wait' EXIT
for mode in ${MODES:-device host}; do
  tier=(); [ $mode = host ] && tier=(--kv-host-cache-mb "$HOST_MB")
  pages=$PAGES; [ $mode = roomy ] && pages=$ROOMY_PAGES
  python3 -m disagg --role mixed --listen "tcp://127.0.0.1:$PORT" --devices "$DEVICE" \
    --model "$MODEL_DIR" "${WEIGHTS[@]}" --dtype "$DTYPE" --page-size 16 \
    --num-pages "$pages" --max-model-len 8192 --max-running 64 --startup-timeout 400 \
    "${tier[@]}" ${EXTRA:-} > "$WORK/node_$mode.log" 2>&1 &
  PID=$!
  for _ in $(seq 1 400); do grep -q "ready: " "$WORK/node_$mode.log" && break; sleep 1; done
  grep -q "ready: " "$WORK/node_$mode.log" || { tail -30 "$WORK/node_$mode.log"; exit 1; }
  timeout 1500 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:$PORT" \
    --workload multiturn --num-conversations "$CONVS" --num-turns "$TURNS" \
    --system-len "$SYSTEM" --user-len "$USER_LEN" --output-len "$OUTLEN" \
    --max-concurrency "$CONC" --request-rate inf --vocab-size "$VOCAB" --seed 0 --warmup 2 \
    --timeout 600 --wait 60 --label "multiturn $CONVS x $TURNS, $mode" \
    --json "$WORK/multiturn_$mode.json" || echo "bench ($mode) failed"
  windows=fresh; [ $mode = host ] && windows=device,host,fresh
  [ "${TPOT:-1}" = 0 ] || [ $mode = roomy ] || timeout 900 python3 bench/kv_tiers_tpot.py --connect "tcp://127.0.0.1:$PORT" \
    --windows "$windows" --steady "$STEADY" --steady-out "$STEADY_OUT" --prefix "$PREFIX" \
    --prefixes "$TPOT_PREFIXES" --flood $((PAGES * 16 * 2)) --vocab "$VOCAB" \
    --json "$WORK/tpot_$mode.json" || echo "tpot bench ($mode) failed"
  if [ $mode = host ]; then
    timeout 900 python3 bench/kv_tiers_hit.py --connect "tcp://127.0.0.1:$PORT" \
      --prefix "$PREFIX" --flood $((PAGES * 16 * 2)) --vocab "$VOCAB" \
      --json "$WORK/hit.json" || echo "hit bench failed"
  fi
  kill -TERM $PID; wait $PID; PID=
done
python3 - "$WORK" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
runs = {}
for mode in ("device", "host", "roomy"):
    p = work / f"multiturn_{mode}.json"
    if p.exists():
        s = json.loads(p.read_text())["summary"]
        m = s["multiturn"]
        runs[mode] = (m["later_turns_ttft_ms"]["p50"], s["tpot_ms"]["p50"], m["tier_hit_tokens"],
                      m["prefix_hit_rate"])
for mode, (ttft, tpot, tiers, hit) in runs.items():
    print(f"{mode:>6}: later turns TTFT p50 {ttft:.1f} ms, TPOT p50 {tpot:.2f} ms, "
          f"prefix hit rate {hit:.3f}, tokens by tier {tiers}")
if "roomy" in runs and "host" in runs and runs["roomy"][0]:
    print(f"later turns TTFT p50, host tier / a device cache that holds everything: "
          f"{runs['host'][0] / runs['roomy'][0]:.3f}; that cache / device only: "
          f"{runs['roomy'][0] / runs['device'][0]:.3f} (the floor of the issue's ratio)")
if "device" in runs and "host" in runs and runs["device"][0]:
    print(f"later turns TTFT p50, host tier / device only: {runs['host'][0] / runs['device'][0]:.3f}"
          f" (issue: <= 0.4); TPOT p50 ratio {runs['host'][1] / runs['device'][1]:.3f}")
tpot = {m: json.loads((work / f"tpot_{m}.json").read_text())
        for m in ("device", "host") if (work / f"tpot_{m}.json").exists()}
if "host" in tpot:
    h = tpot["host"]
    d, r = h.get("device", {}).get("tpot_ms_p50"), h.get("host", {}).get("tpot_ms_p50")
    if d and r:
        print(f"steady TPOT p50 while host hits reload {r:.2f} ms vs device hits {d:.2f} ms: "
              f"{r / d:.3f} (issue: <= 1.05)")
    f_host = h.get("fresh", {}).get("tpot_ms_p50")
    f_dev = tpot.get("device", {}).get("fresh", {}).get("tpot_ms_p50")
    if f_host and f_dev:
        print(f"steady TPOT p50 beside fresh prompts, host tier copying out {f_host:.2f} ms vs "
              f"no host tier {f_dev:.2f} ms: {f_host / f_dev:.3f} (issue: <= 1.05)")
hit = work / "hit.json"
if hit.exists():
    h = json.loads(hit.read_text())
    print(f"{h['prefix']}-token prefix: device hit TTFT p50 {h['ttft_ms_p50']['device']:.2f} ms, "
          f"host hit {h['ttft_ms_p50']['host']:.2f} ms, ratio {h['host_over_device']:.3f} "
          "(issue: <= 1.3)")
EOF
