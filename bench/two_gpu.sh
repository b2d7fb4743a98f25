#!/usr/bin/env bash
# Issue 19's two-GPU runs, in order, each under `timeout`, results under WORK:
#   bench/two_gpu.sh WORK [a] [b] [c] [d] [e]        (no part named: all five)
#   a  cuda-ipc GPU0 -> GPU1 page-run sweep (`disagg-bench fabric --backend cuda-ipc`, the two
#      commands of docs/BENCHMARKS.md "cuda-ipc, GPU0 -> GPU1"); each row holds the peer-copy
#      ceiling (one tensor.copy_ of the same bytes in the same round) and the ratio to it
#   b  serving experiment, 2 mixed replicas vs 1P1D, goodput at SLO_TTFT_MS / SLO_TPOT_MS
#      (bench/experiment_serve.sh, WORKLOAD "fixed sharegpt": 4096/256 and ShareGPT-like), then
#      bench/experiment_report.py (goodput table)
#   c  exposed-transfer sweep 1k-32k, decode node on DEV1 (bench/ttft_tail.sh, DECODE_DEVICE)
#   d  TP 2 over NCCL (--tp 2 --devices DEV0,DEV1): greedy of a tiny float32 model equal to
#      transformers' and to TP 1, a Qwen3-8B shape with TP_LAYERS layers (float32, random
#      weights) TP 1 vs TP 2, then decode at batch 64 (Qwen3-8B shape, bf16) TP 1 vs TP 2
#      (`disagg-bench serve --max-concurrency 64`, TPOT/ITL). Skipped when DEV0 = DEV1.
#   e  pytest -m "gpu or multi_gpu" tests/procs/test_gpu_transfer.py (decode nodes on DEV1:
#      DISAGG_TEST_DECODE_DEVICE) and any other multi_gpu test
# Setup first: wheels from .whl into /tmp/site when msgspec/zmq are missing, the libfabric
# binding built with the headers in .fabinc (carry .whl and .fabinc). Ends with a summary
# (also WORK/summary.txt).
#
# Two GPUs (nvidia-h200-x2), two device calls, timeout_s 600 each, carry [".whl", ".fabinc"]
# (call 1 about 450 s: a ~70, c ~80, d ~150, e ~130; call 2 about 350 s):
#   1) bash bench/two_gpu.sh /tmp/w a c d e > $OUT/log.txt 2>&1; tar czf $OUT/w1.tgz -C /tmp w;
#      tail -c 9000 $OUT/log.txt
#   2) bash bench/two_gpu.sh /tmp/w b > $OUT/log.txt 2>&1; tar czf $OUT/w2.tgz -C /tmp w;
#      tail -c 9000 $OUT/log.txt
# (WORK outside $OUT: at most 8 files come back, so the tarball carries the JSON and logs.)
# (part b: 2 systems x (start-up ~20 s + fixed 4 rates + sharegpt 4 rates, ~15-25 s each);
# shorten with RATES, SHAREGPT_RATES or SECONDS_PER_RATE; T_B caps it at 540 s.)
#
# One GPU, dry run of every part but d (both "GPUs" cuda:0, small pools; about 260 s; run it
# with timeout_s 420, carry [".whl", ".fabinc"]):
#   DEV1=cuda:0 FABRIC_TOTAL=268435456 FABRIC_ROUNDS=2 FABRIC_SIZES=1048576,16777216
#   FABRIC_SIZES2=1048576 RATES=4 SHAREGPT_RATES=8 SECONDS_PER_RATE=3 MIN_PROMPTS=8
#   NODE_MEM="--num-pages 4096" LONG_LENS="1024 4096" N_LONG=3 N_SHORT=4 TTFT_PAGES=1024
#   TTFT_MAXLEN=8192 bash bench/two_gpu.sh /tmp/w > $OUT/log.txt 2>&1; tar czf $OUT/w.tgz -C /tmp w;
#   tail -c 9000 $OUT/log.txt
#
# CPU dry run (b, c; a and e need CUDA and say so; d needs two devices): tiny config, e.g.
#   CONFIG_JSON=tiny/config.json DEV0=cpu DEV1=cpu TRANSFER=fabric DTYPE=float32 VOCAB=300
#   IN=64 OUTLEN=8 RATES="2 4" SHAREGPT_RATES="2 4" SG_MAX_IN=128 SG_MAX_OUT=16
#   SECONDS_PER_RATE=3 MIN_PROMPTS=6 MAXLEN=512 NODE_MEM="--num-pages 256 --threads 1"
#   LONG_LENS="64 128" SHORT_LENS="17 30" N_LONG=2 N_SHORT=2 TTFT_PAGES=256 TTFT_MAXLEN=512
#   TTFT_PAGE=4 bash bench/two_gpu.sh /tmp/w b c
#
# Overrides: DEV0 DEV1 (cuda:0 cuda:1), TRANSFER (cuda-ipc), DTYPE (bfloat16), CONFIG_JSON
# (default the Qwen3-8B shape), SLO_TTFT_MS (1000) SLO_TPOT_MS (25), WORKLOAD ("fixed sharegpt"),
# the experiment_serve.sh and ttft_tail.sh variables (RATES, SHAREGPT_RATES, SECONDS_PER_RATE,
# NODE_MEM, IN, OUTLEN, LONG_LENS, ...; TTFT_PAGES/TTFT_MAXLEN/TTFT_PAGE become ttft_tail's
# PAGES/MAXLEN/PAGE), FABRIC_SIZES FABRIC_SIZES2 FABRIC_TOTAL FABRIC_ROUNDS FABRIC_COPY FABRIC_COPY2,
# TP_LAYERS (4) TP_IN (128) TP_OUT (256) TP_PAGES (4096), T_A T_B T_C T_D T_E (timeouts, s).
set -u
WORK=${1:?usage: two_gpu.sh WORK [a] [b] [c] [d] [e]}
shift
PARTS=${*:-a b c d e}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
cd "$ROOT" || exit 1
export DEV0=${DEV0:-cuda:0} DEV1=${DEV1:-cuda:1} TRANSFER=${TRANSFER:-cuda-ipc}
export DTYPE=${DTYPE:-bfloat16} SLO_TTFT_MS=${SLO_TTFT_MS:-1000} SLO_TPOT_MS=${SLO_TPOT_MS:-25}
export WORKLOAD=${WORKLOAD:-fixed sharegpt} PYTHONUNBUFFERED=1
SUMMARY=$WORK/summary.txt
: > "$SUMMARY"
note() { echo "$*"; echo "$*" >> "$SUMMARY"; }
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
T00=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T00 )) s]"; }

# ---- setup: missing wheels, the libfabric binding (cuda-ipc's `ce` copies use it)
source "$ROOT/bench/device_env.sh"
device_env "$ROOT" || note "setup: wheel install failed"
fabric_binding "$ROOT" "$WORK/fabric_build.log" \
  || note "setup: libfabric binding not built (see fabric_build.log)"
python3 -c "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, \
'cuda devices', n, [torch.cuda.get_device_name(i) for i in range(n)])" | tee -a "$SUMMARY"
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))")
note "devices: DEV0=$DEV0 DEV1=$DEV1, transfer $TRANSFER, SLOs TTFT <= $SLO_TTFT_MS ms," \
  "TPOT <= $SLO_TPOT_MS ms; parts: $PARTS"
MODEL_CFG=$WORK/qwen3_8b.json
if [ -n "${CONFIG_JSON:-}" ]; then cp "$CONFIG_JSON" "$MODEL_CFG"; else
  python3 -c "import json, sys; sys.path.insert(0, 'bench'); from experiment_engine import QWEN3_8B; \
json.dump(QWEN3_8B, open(sys.argv[1], 'w'))" "$MODEL_CFG" || exit 1
fi

# ---- (a) cuda-ipc GPU0 -> GPU1 against the peer copy
if has a; then
  echo "=== (a) cuda-ipc sweep $(stamp)"
  if [ "$CUDA" != 1 ]; then note "(a) skipped: no CUDA"; else
    # the bench copies GPU0 -> the last visible GPU: show it exactly DEV0 and DEV1
    vis=${DEV0#cuda:}; [ "$DEV1" != "$DEV0" ] && vis=$vis,${DEV1#cuda:}
    FB="timeout ${T_A:-150} env CUDA_VISIBLE_DEVICES=$vis python3 -m disagg.bench fabric \
      --backend cuda-ipc --no-pin --json --total-bytes ${FABRIC_TOTAL:-1073741824} \
      --rounds ${FABRIC_ROUNDS:-5}"
    $FB --page-sizes "${FABRIC_SIZES:-262144,1048576,4194304,16777216}" \
      --copy "${FABRIC_COPY:-auto,kernel:32,ce,loop}" > "$WORK/cuda_ipc.json" 2> "$WORK/cuda_ipc.err"
    note "(a) sweep 1 rc=$?"
    $FB --page-sizes "${FABRIC_SIZES2:-262144,1048576,16777216}" --copy "${FABRIC_COPY2:-kernel,\
kernel::8:4096:0,kernel:132:8:8192:1,kernel:528:4:4096:1,kernel:264:16:8192:0,ce:2,ce:4,ce:8}" \
      > "$WORK/cuda_ipc_modes.json" 2> "$WORK/cuda_ipc_modes.err"
    note "(a) sweep 2 rc=$?"
    python3 - "$WORK" <<'EOF' | tee -a "$SUMMARY"
import json, sys
for name in ("cuda_ipc", "cuda_ipc_modes"):
    try:
        res = json.loads(open(f"{sys.argv[1]}/{name}.json").read().strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        print(f"(a) {name}: no result ({e}); see {name}.err")
        continue
    print(f"(a) {name}: {res['total_bytes'] >> 20} MiB per round, median of {res['rounds']}")
    for r in res["sweep"]:
        mark = "  >= 0.85" if r["page_size"] >= 1 << 20 and r["ratio"] >= 0.85 else ""
        print(f"    {r['copy']:>22} {r['page_size'] >> 10:6d} KiB runs: "
              f"{r['engine']['gib_s']:6.1f} GiB/s, peer copy {r['peer_copy']['gib_s']:6.1f}, "
              f"ratio {r['ratio']:.2f}{mark}")
EOF
  fi
fi

# ---- (b) serving experiment with goodput
if has b; then
  echo "=== (b) serving experiment $(stamp)"
  mkdir -p "$WORK/serve"
  CONFIG_JSON=$MODEL_CFG timeout "${T_B:-540}" bash bench/experiment_serve.sh "$WORK/serve" both \
    2>&1 | tee "$WORK/serve.log"
  note "(b) experiment_serve.sh rc=${PIPESTATUS[0]}"
  timeout 60 python3 bench/experiment_report.py "$WORK/serve" > "$WORK/serve_report.md" 2>&1
  awk '/^Goodput/ {p = 1} p && /^- / {exit} p' "$WORK/serve_report.md" | tee -a "$SUMMARY"
fi

# ---- (c) exposed-transfer sweep, decode node on DEV1
if has c; then
  echo "=== (c) TTFT tail, decode on $DEV1 $(stamp)"
  mkdir -p "$WORK/ttft"
  CONFIG_JSON=$MODEL_CFG DEVICE=$DEV0 DECODE_DEVICE=$DEV1 LONG_LENS=${LONG_LENS:-1024 4096 16384 32768} \
    PAGES=${TTFT_PAGES:-4608} MAXLEN=${TTFT_MAXLEN:-33792} PAGE=${TTFT_PAGE:-16} \
    timeout "${T_C:-240}" bash bench/ttft_tail.sh "$WORK/ttft" 2>&1 | tee "$WORK/ttft.log"
  note "(c) ttft_tail.sh rc=${PIPESTATUS[0]}"
  [ -f "$WORK/ttft/summary.txt" ] && tee -a "$SUMMARY" < "$WORK/ttft/summary.txt"
fi

# ---- (d) TP 2 over NCCL
if has d; then
  echo "=== (d) TP 2 $(stamp)"
  if [ "$DEV0" = "$DEV1" ]; then
    note "(d) skipped: one device ($DEV0); --tp 2 needs two"
  else (
    source bench/nodes.sh  # start_node, wait_ready, stop_nodes (in this subshell)
    NODE_TIMEOUT=${T_D:-240}
    D=$WORK/tp; mkdir -p "$D/tiny" "$D/shape" "$D/big"; WORK=$D
    python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from tinymodels import make_tiny_model; make_tiny_model('qwen3', Path(sys.argv[1]))" "$D/tiny" \
      > /dev/null 2>&1 || note "(d) tiny model not made"
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); \
c['num_hidden_layers'] = int(sys.argv[3]); c.pop('layer_types', None); \
json.dump(c, open(sys.argv[2], 'w'))" "$MODEL_CFG" "$D/shape/config.json" "${TP_LAYERS:-4}"
    cp "$MODEL_CFG" "$D/big/config.json"
    F=(--role mixed --page-size 16 --startup-timeout 200)
    start_node tiny1 "${F[@]}" --model "$D/tiny" --dtype float32 --num-pages 256 \
      --devices "$DEV0" --listen tcp://127.0.0.1:6310
    start_node tiny2 "${F[@]}" --model "$D/tiny" --dtype float32 --num-pages 256 --tp 2 \
      --devices "$DEV0,$DEV1" --listen tcp://127.0.0.1:6311
    R=(--random-weights --seed 0 --max-model-len 4096 --num-pages "${TP_PAGES:-4096}")
    start_node shape1 "${F[@]}" --model "$D/shape" "${R[@]}" --dtype float32 --devices "$DEV0" \
      --listen tcp://127.0.0.1:6312
    start_node shape2 "${F[@]}" --model "$D/shape" "${R[@]}" --dtype float32 --tp 2 \
      --devices "$DEV0,$DEV1" --listen tcp://127.0.0.1:6313
    ok=1; for n in tiny1 tiny2 shape1 shape2; do wait_ready $n 200 || ok=0; done
    if [ $ok = 1 ]; then
      timeout 120 python3 - "$D/tiny" <<'EOF' | tee -a "$SUMMARY"
import sys
sys.path.insert(0, "tests")
from disagg.client import Client
from disagg.protocol import SamplingParams
def greedy(addr, prompts, n):
    c = Client(addr)
    try:
        return [[t for m in c.generate(prompt_token_ids=p, sampling=SamplingParams(
            max_tokens=n, ignore_eos=True)) for t in getattr(m, "token_ids", [])] for p in prompts]
    finally:
        c.close()
def prompts(vocab):
    return [[(7 + 31 * i * (k + 1)) % (vocab - 10) + 10 for i in range(n)]
            for k, n in enumerate((1, 5, 13, 40, 150))]
def same(a, b):
    return sum(x == y for x, y in zip(a, b)), len(a)
tiny = prompts(300)
t1, t2 = greedy("tcp://127.0.0.1:6310", tiny, 16), greedy("tcp://127.0.0.1:6311", tiny, 16)
try:
    from tinymodels import hf_greedy
    hf = [hf_greedy(sys.argv[1], p, 16) for p in tiny]
except Exception as e:  # noqa: BLE001
    hf = None
    print(f"(d) transformers reference unavailable: {e}")
print(f"(d) tiny qwen3 float32: TP2 == TP1 on {same(t1, t2)[0]}/5 prompts"
      + ("" if hf is None else f", TP1 == transformers {same(t1, hf)[0]}/5, "
         f"TP2 == transformers {same(t2, hf)[0]}/5"))
big = prompts(150000)
s1, s2 = greedy("tcp://127.0.0.1:6312", big, 32), greedy("tcp://127.0.0.1:6313", big, 32)
first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(s1, s2)]
print(f"(d) Qwen3-8B shape, reduced layers, float32 random weights: TP2 == TP1 on "
      f"{same(s1, s2)[0]}/5 prompts (32 tokens; first differing position per prompt: {first})")
EOF
    else note "(d) greedy check: a node did not start (see $D/*.log)"; fi
    stop_nodes
    B=(--random-weights --seed 0 --dtype "$DTYPE" --max-model-len 4096 --max-running 64
       --num-pages "${TP_PAGES:-4096}")
    start_node tp1 "${F[@]}" --model "$D/big" "${B[@]}" --devices "$DEV0" \
      --listen tcp://127.0.0.1:6320
    start_node tp2 "${F[@]}" --model "$D/big" "${B[@]}" --tp 2 --devices "$DEV0,$DEV1" \
      --listen tcp://127.0.0.1:6321
    if wait_ready tp1 200 && wait_ready tp2 200; then
      for tp in 1 2; do
        timeout 120 python3 -m disagg.bench serve --connect "tcp://127.0.0.1:632$((tp - 1))" \
          --num-prompts 128 --max-concurrency 64 --input-len "${TP_IN:-128}" \
          --output-len "${TP_OUT:-256}" --vocab-size "${VOCAB:-150000}" --seed 0 --warmup 2 \
          --timeout 100 --label "TP $tp, batch 64" --json "$D/tp${tp}_b64.json" --quiet \
          || note "(d) TP $tp batch 64 failed"
        python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; \
print(f\"(d) TP {sys.argv[2]} batch 64: done {s['completed']}/{s['num_requests']}, TPOT p50 \
{s['tpot_ms']['p50']:.2f} ms, ITL p50 {s['itl_ms']['p50']:.2f} ms, out {s['output_throughput']:.0f} tok/s\")" \
          "$D/tp${tp}_b64.json" "$tp" 2>/dev/null | tee -a "$SUMMARY"
      done
    else note "(d) batch 64: a node did not start (see $D/tp*.log)"; fi
    stop_nodes
  ) fi
fi

# ---- (e) GPU transfer tests and every multi_gpu test
if has e; then
  echo "=== (e) pytest $(stamp)"
  if [ "$CUDA" != 1 ]; then note "(e) skipped: no CUDA"; else
    DISAGG_TEST_DECODE_DEVICE=$DEV1 timeout "${T_E:-180}" python3 -m pytest -q -p no:cacheprovider \
      -m "gpu or multi_gpu" tests/procs/test_gpu_transfer.py --basetemp=/tmp/gt \
      > "$WORK/pytest_gpu_transfer.log" 2>&1
    note "(e) test_gpu_transfer.py rc=$? (decode device $DEV1): $(tail -n 1 "$WORK/pytest_gpu_transfer.log")"
    # only the files that use the marker: collecting all of tests/ needs packages the GPU
    # machine lacks (openai, kubernetes-validate)
    others=$(grep -rl "multi_gpu" tests --include='test_*.py' | grep -v test_gpu_transfer.py)
    if [ -z "$others" ]; then note "(e) no other multi_gpu tests"; else
      # shellcheck disable=SC2086
      timeout 120 python3 -m pytest -q -p no:cacheprovider -m multi_gpu $others \
        --basetemp=/tmp/mg > "$WORK/pytest_multi_gpu.log" 2>&1
      rc=$?
      [ $rc = 5 ] && note "(e) no other multi_gpu tests selected" \
        || note "(e) other multi_gpu tests rc=$rc: $(tail -n 1 "$WORK/pytest_multi_gpu.log")"
    fi
  fi
fi

echo
echo "===== summary ($(stamp))"
cat "$SUMMARY"
