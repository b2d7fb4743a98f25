#!/usr/bin/env bash
# DP attention with expert parallelism on GPUs (issue 37; the two-GPU runs of issue 40), each
# part under `timeout`, results under WORK:
#   bench/dp_ep.sh WORK [a] [b] [c] [d]        (no part named: all four)
#   a  tiny Qwen3-MoE and DeepSeek-V3 (float32, saved checkpoints): greedy of `--dp 2
#      --expert-parallel --devices DEV0,DEV1` against `--devices DEV0` and transformers
#   b  Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (random bf16 weights, LAYERS layers; an EP rank
#      draws exactly its experts of the one-rank model): greedy of `--dp 2 --expert-parallel`
#      equal to `--dp 1`; decode at batch 64 per rank (`disagg-bench serve`, concurrency 64 on
#      --dp 1, 128 on --dp 2), the all-to-all seconds per step and per MoE layer from
#      Stats.dp_ranks; `--dp 2` without EP (CUDA graphs per rank) beside it: with EP decode
#      runs eagerly (the all-to-all's split sizes go through the host)
#   c  bench/a2a_probe.py: all_to_all_single of one layer's rows against a GPU0 -> GPU1 copy
#      of the same bytes, measured in the same run
#   d  prefill --tp 2 -> decode --dp 2 --expert-parallel over cuda-ipc (TRANSFER), tiny
#      Qwen3-MoE float32: greedy equal to transformers, both decoder ranks used (the exposed
#      transfer sweep at 1k/4k/16k is bench/ttft_tail.sh's, not wired to --dp here)
# One GPU (DEV1 = DEV0, the default when only one is visible): a and b run the degenerate case,
# `--dp 1 --expert-parallel` against the plain node on DEV0 (the same code path: equal tokens,
# equal step times); c is skipped; d runs prefill on DEV0 -> decode --dp 2 with both ranks on
# DEV0 (no EP: no collective runs there).
#
# Two GPUs (nvidia-h200-x2), one device call, timeout_s 600, carry [".whl"] if msgspec/zmq are
# missing there (about 400 s: a ~60, b ~250, c ~30):
#   bash bench/dp_ep.sh /tmp/w > $OUT/log.txt 2>&1; tar czf $OUT/w.tgz -C /tmp w;
#   tail -c 9000 $OUT/log.txt
# Overrides: DEV0 DEV1 (cuda:0 cuda:1), SHAPES ("qwen3moe v2lite"), LAYERS (4), PAGES (4096 per
# rank), IN (128) OUTLEN (128), REVERSE (1: part b's benchmarks in the other order), T_A T_B
# T_C (timeouts, s), PY (python3). CPU dry run of the two-rank path:
#   PY=.venv/bin/python DEV0=cpu DEV1=cpu FORCE_TWO=1 bash bench/dp_ep.sh /tmp/w a
set -u
PY=${PY:-python3}
WORK=${1:?usage: dp_ep.sh WORK [a] [b] [c] [d]}
shift
PARTS=${*:-a b c d}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
source "$ROOT/bench/device_env.sh"
device_env "$ROOT" "$PY" || echo "setup: wheel install failed"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
DEV0=${DEV0:-cuda:0}
if [ -z "${DEV1:-}" ]; then if [ "$NGPU" -ge 2 ]; then DEV1=cuda:1; else DEV1=$DEV0; fi; fi
SUMMARY=$WORK/summary.txt
: > "$SUMMARY"
note() { echo "$*"; echo "$*" >> "$SUMMARY"; }
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
source bench/nodes.sh  # start_node, wait_ready, stop_nodes
if [ "$DEV1" = "$DEV0" ] && [ "${FORCE_TWO:-0}" != 1 ]; then
  ONE=1; WIDE=(--dp 1 --expert-parallel --devices "$DEV0")
  note "one GPU ($DEV0): the degenerate case, --dp 1 --expert-parallel against the plain node"
else
  ONE=0; WIDE=(--dp 2 --expert-parallel --devices "$DEV0,$DEV1")
  note "two GPUs: --dp 2 --expert-parallel on $DEV0,$DEV1 against --dp 1 on $DEV0"
fi
F=(--role mixed --page-size 16 --startup-timeout 300)

greedy_py() {  # addr_a addr_b vocab tokens [hf_dir]: compare greedy outputs of two nodes
  timeout 300 "$PY" - "$@" <<'EOF'
import sys
sys.path.insert(0, "tests")
from disagg.client import Client
from disagg.protocol import SamplingParams
a, b, vocab, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = [[(7 + 31 * i * (k + 1)) % (vocab - 10) + 10 for i in range(m)]
           for k, m in enumerate((1, 5, 13, 40, 150))]
def greedy(addr):
    c = Client(addr)
    try:
        return [[t for m in c.generate(prompt_token_ids=p, sampling=SamplingParams(
            max_tokens=n, ignore_eos=True)) for t in getattr(m, "token_ids", [])] for p in prompts]
    finally:
        c.close()
ga, gb = greedy(a), greedy(b)
same = sum(x == y for x, y in zip(ga, gb))
first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(ga, gb)]
line = f"wide == one-rank on {same}/5 prompts ({n} tokens; first difference per prompt {first})"
if len(sys.argv) > 5:
    from tinymodels import hf_greedy
    hf = [hf_greedy(sys.argv[5], p, n) for p in prompts]
    line += f", one-rank == transformers {sum(x == y for x, y in zip(gb, hf))}/5"
    line += f", wide == transformers {sum(x == y for x, y in zip(ga, hf))}/5"
print(line)
EOF
}

ranks_py() {  # addr steps_layers: all-to-all seconds per rank from Stats.dp_ranks
  timeout 30 "$PY" - "$@" <<'EOF'
import sys
from disagg.client import Client
c = Client(sys.argv[1])
try:
    s = c.stats()
finally:
    c.close()
print("dp ranks:", [(r.rank, r.started, round(r.all_to_all_s, 3)) for r in s.dp_ranks]
      or "(one rank: none)")
EOF
}

# ---- (a) tiny models, token-exact
if has a; then
  echo "=== (a) tiny models"
  for kind in qwen3_moe deepseek_v3; do (
    D=$WORK/a_$kind; mkdir -p "$D"; WORK=$D; NODE_TIMEOUT=${T_A:-200}
    "$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from tinymodels import make_tiny_model; make_tiny_model(sys.argv[1], Path(sys.argv[2]))" \
      "$kind" "$D/model" > /dev/null 2>&1 || note "(a) $kind: tiny model not made"
    M=(--model "$D/model" --dtype float32 --num-pages 256)
    start_node wide "${F[@]}" "${M[@]}" "${WIDE[@]}" --listen tcp://127.0.0.1:6410
    start_node one "${F[@]}" "${M[@]}" --devices "$DEV0" --listen tcp://127.0.0.1:6411
    if wait_ready wide 200 && wait_ready one 200; then
      note "(a) $kind: $(greedy_py tcp://127.0.0.1:6410 tcp://127.0.0.1:6411 300 16 "$D/model")"
      note "(a) $kind: $(ranks_py tcp://127.0.0.1:6410)"
    else note "(a) $kind: a node did not start (see $D/*.log)"; fi
    stop_nodes
  ) done
fi

# ---- (b) model shapes: greedy equal, batch 64 per rank, all-to-all time
if has b; then
  echo "=== (b) model shapes"
  for shape in ${SHAPES:-qwen3moe v2lite}; do (
    D=$WORK/b_$shape; mkdir -p "$D/model"; WORK=$D; NODE_TIMEOUT=${T_B:-300}
    "$PY" -c "import json, sys; sys.path.insert(0, 'bench'); from sparse_engine import SHAPES; \
c = dict(SHAPES[sys.argv[1]]); c['num_hidden_layers'] = int(sys.argv[3]); \
json.dump(c, open(sys.argv[2], 'w'))" "$shape" "$D/model/config.json" "${LAYERS:-4}" || exit 1
    VOCAB=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
      "$D/model/config.json")
    M=(--model "$D/model" --random-weights --seed 0 --dtype bfloat16 --max-model-len 4096
       --num-pages "${PAGES:-4096}" --max-running 64)
    runs=("wide ${WIDE[*]}" "one --devices $DEV0")
    [ "$ONE" = 0 ] && runs+=("dp2graphs --dp 2 --devices $DEV0,$DEV1")
    port=6420
    for run in "${runs[@]}"; do
      set -- $run; name=$1; shift
      start_node "$name" "${F[@]}" "${M[@]}" "$@" --listen "tcp://127.0.0.1:$port"
      port=$((port + 1))
    done
    ok=1; for run in "${runs[@]}"; do wait_ready "${run%% *}" 280 || ok=0; done
    if [ $ok = 1 ]; then
      note "(b) $shape (${LAYERS:-4} layers): $(greedy_py tcp://127.0.0.1:6420 tcp://127.0.0.1:6421 "$VOCAB" 32)"
      idx=$(seq 0 $((${#runs[@]} - 1)))
      [ "${REVERSE:-0}" = 1 ] && idx=$(seq $((${#runs[@]} - 1)) -1 0)  # order effects
      for i in $idx; do
        run=${runs[$i]}; port=$((6420 + i))
        name=${run%% *}; conc=64
        [ "$name" != one ] && [ "$ONE" = 0 ] && conc=128
        timeout 200 "$PY" -m disagg.bench serve --connect "tcp://127.0.0.1:$port" \
          --num-prompts $((conc * 2)) --max-concurrency $conc --input-len "${IN:-128}" \
          --output-len "${OUTLEN:-128}" --vocab-size "$VOCAB" --seed 0 --warmup 2 --timeout 180 \
          --label "$shape $name batch $conc" --json "$D/$name.json" --quiet \
          || note "(b) $shape $name: serve failed"
        "$PY" -c "import json, sys; s = json.load(open(sys.argv[1]))['summary']; \
print(f\"(b) {sys.argv[2]} batch {sys.argv[3]}: done {s['completed']}/{s['num_requests']}, TPOT \
p50 {s['tpot_ms']['p50']:.2f} ms, ITL p50 {s['itl_ms']['p50']:.2f} ms, out \
{s['output_throughput']:.0f} tok/s\")" "$D/$name.json" "$shape $name" "$conc" 2>/dev/null \
          | tee -a "$SUMMARY"
        note "(b) $shape $name: $(ranks_py "tcp://127.0.0.1:$port")"
      done
    else note "(b) $shape: a node did not start (see $D/*.log)"; fi
    stop_nodes
  ) done
fi

# ---- (c) all-to-all against the copy rate
if has c; then
  echo "=== (c) all-to-all probe"
  if [ "$ONE" = 1 ]; then note "(c) skipped: one GPU"; else
    timeout "${T_C:-120}" "$PY" bench/a2a_probe.py --ranks 2 --hidden 2048 \
      --rows 512,4096,32768 > "$WORK/a2a.json" 2> "$WORK/a2a.err"
    note "(c) a2a_probe rc=$?"
    "$PY" - "$WORK/a2a.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
try:
    res = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as e:  # noqa: BLE001
    sys.exit(f"(c) no result ({e}); see a2a.err")
for r in res["sweep"]:
    print(f"(c) {r['rows']:6d} rows x {res['hidden']}: all-to-all {r['all_to_all_ms']:.3f} ms "
          f"({r['all_to_all_gb_s']:.1f} GB/s across), counts {r['counts_ms']:.3f} ms, peer copy "
          f"{r['peer_copy_ms']:.3f} ms ({r['peer_copy_gb_s']:.1f} GB/s)")
EOF
  fi
fi

# ---- (d) prefill -> decode with DP over cuda-ipc (tiny Qwen3-MoE, float32), token-exact
if has d; then
  echo "=== (d) prefill -> decode --dp 2 over ${TRANSFER:-cuda-ipc}"
  (
    D=$WORK/d; mkdir -p "$D"; WORK=$D; NODE_TIMEOUT=${T_D:-200}
    "$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from tinymodels import make_tiny_model; make_tiny_model('qwen3_moe', Path(sys.argv[1]))" \
      "$D/model" > /dev/null 2>&1 || note "(d) tiny model not made"
    M=(--model "$D/model" --dtype float32 --num-pages 256 --page-size 16 --startup-timeout 300
       --transfer-backend "${TRANSFER:-cuda-ipc}")
    if [ "$ONE" = 1 ]; then  # one GPU: two DP ranks on it, no EP (no collective runs)
      P=(--devices "$DEV0"); DD=(--dp 2 --devices "$DEV0,$DEV0")
    else
      P=(--tp 2 --devices "$DEV0,$DEV1"); DD=(--dp 2 --expert-parallel --devices "$DEV0,$DEV1")
    fi
    start_node prefill --role prefill "${M[@]}" "${P[@]}" --listen tcp://127.0.0.1:6430
    if wait_ready prefill 150; then
      start_node decode --role decode "${M[@]}" "${DD[@]}" --listen tcp://127.0.0.1:6431 \
        --prefill-peer tcp://127.0.0.1:6430 --local-prefill-max-tokens 0
      if wait_ready decode 150; then
        sleep 3  # the decoder's first Ping round
        note "(d) prefill ${P[*]} -> decode ${DD[*]}: $(timeout 200 "$PY" - "$D/model" <<'EOF'
import sys
sys.path.insert(0, "tests")
from disagg.client import Client
from disagg.protocol import SamplingParams
from tinymodels import hf_greedy
prompts = [[(7 + 31 * i * (k + 1)) % 290 + 10 for i in range(m)] for k, m in enumerate((2, 9, 40))]
c = Client("tcp://127.0.0.1:6431")
try:
    got = [[t for m in c.generate(prompt_token_ids=p, sampling=SamplingParams(
        max_tokens=8, ignore_eos=True)) for t in getattr(m, "token_ids", [])] for p in prompts]
    s = c.stats()
finally:
    c.close()
same = sum(g == hf_greedy(sys.argv[1], p, 8) for g, p in zip(got, prompts))
print(f"{same}/3 prompts equal transformers, {s.kv_units_received} units received, "
      f"ranks {[(r.rank, r.started) for r in s.dp_ranks]}")
EOF
)"
      else note "(d) the decode node did not start (see $D/decode.log)"; fi
    else note "(d) the prefill node did not start (see $D/prefill.log)"; fi
    stop_nodes
  )
fi

echo
echo "===== summary"
cat "$SUMMARY"
