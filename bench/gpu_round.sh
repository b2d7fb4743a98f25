#!/usr/bin/env bash
# The open one-GPU measurements of issues 33/34/38/39, part by part, each a run of this tree's
# own entry points (nothing is measured here itself):
#   gputests  the gpu tests of the transfer path (on one GPU; its cuda-ipc+graphs pair has a
#             prefill node capture the decode graphs, DISAGG_PREFILL_GRAPHS=1, the default)
#             and of rows steps
#   ttft0 ttft1  bench/ttft_tail.sh's short prompts (SHORT_LENS, and LONG_LENS 1024) with
#             DISAGG_PREFILL_GRAPHS 0 / 1: the split's short TTFT against the mixed node's
#   surface   bench/request_surface.sh at batch 64, plain / JSON-schema / sampled, ROUNDS
#             rounds, traced (DISAGG_TRACE): the collector's marks, and where a constrained
#             step's time goes (bench/grammar_gaps.py); then its n=1 / n=8 runs of a 2k prompt
#             (NS="" skips them) (SURFACE_MODEL: config and tokenizer)
#   surface_swi  the same with DISAGG_SWITCH_INTERVAL_US=${SWITCH_US:-500} (Python's is 5000)
#   surface_sched  the same with DISAGG_EXECUTOR_MASKS=0: the late masks filled by the
#             scheduler's grammar pass and sent to the executors (the default before
#             2026-12-08; by default the executors fill them, disagg.engine.grammar_mirror)
#   tiers_bf16 tiers_fp8  bench/kv_tiers.sh with bf16 pages / FP8 pages (half the bytes a
#             host hit reloads)
# Results under WORK/<part>, one line each in WORK/summary.txt. Prepare on a machine with a
# registry first: `bash bench/device_prep.sh` (wheels, headers, .device/smodel).
# A part may take most of a 600 s device call (T_PART, default 560 s, bounds each): name the
# parts that fit, one call after another on the machine kept warm (within its idle release).
# A device call, carry [".whl", ".fabinc", ".device"]:
#   bash bench/gpu_round.sh /tmp/r ttft0 ttft1 > $OUT/log.txt 2>&1; cp /tmp/r/summary.txt $OUT/;
#   tar czf $OUT/r.tgz --exclude=trace --exclude=model --exclude='*.safetensors' -C /tmp r
#   bash bench/gpu_round.sh WORK PART...
set -u
WORK=${1:?usage: gpu_round.sh WORK PART...}
shift
PARTS=${*:?name the parts: gputests ttft0 ttft1 surface surface_swi surface_sched tiers_bf16 tiers_fp8}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1
SUMMARY=$WORK/summary.txt
note() { echo "$*"; echo "$*" >> "$SUMMARY"; }
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
T00=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T00 )) s]"; }
SURFACE_MODEL=${SURFACE_MODEL:-$ROOT/.device/smodel}

# ---- setup: missing wheels, the libfabric binding
source "$ROOT/bench/device_env.sh"
device_env "$ROOT" python3 "msgspec, zmq, xgrammar" || note "setup: wheel install failed"
fabric_binding "$ROOT" "$WORK/fabric_build.log" || note "setup: libfabric binding not built"
note "$(stamp) setup done; parts: $PARTS; $(python3 -c 'import torch; print(torch.__version__, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")' 2>&1 | tail -1)"

if has gputests; then
  DISAGG_TEST_DECODE_DEVICE=cuda:0 timeout "${T_PART:-560}" python3 -m pytest -q \
    -p no:cacheprovider -m gpu tests/procs/test_gpu_transfer.py tests/engine/test_rows_step.py \
    > "$WORK/gpu_tests.log" 2>&1
  note "$(stamp) gpu tests rc=$? ($(tail -1 "$WORK/gpu_tests.log"))"
fi

for g in 0 1; do
  has "ttft$g" || continue
  DISAGG_PREFILL_GRAPHS=$g LONG_LENS=${LONG_LENS:-1024} SHORT_LENS=${SHORT_LENS:-"17 64 130"} \
    timeout "${T_PART:-560}" bash bench/ttft_tail.sh "$WORK/ttft$g" > "$WORK/ttft$g.log" 2>&1
  note "$(stamp) ttft_tail with DISAGG_PREFILL_GRAPHS=$g rc=$?"
  [ -f "$WORK/ttft$g/summary.txt" ] && sed "s/^/  ttft$g /" "$WORK/ttft$g/summary.txt" \
    | tee -a "$SUMMARY"
  grep -h "graph\|Triton compiled" "$WORK/ttft$g"/prefill*.log 2>/dev/null | head -5 \
    | sed "s/^/  ttft$g prefill log: /" | tee -a "$SUMMARY"
done

for part in surface surface_swi surface_sched; do
  has "$part" || continue
  rm -rf "$WORK/$part/trace"  # (a WORK used before on a warm machine: only this run's marks)
  mkdir -p "$WORK/$part"
  swi=; [ "$part" = surface_swi ] && swi=${SWITCH_US:-500}
  xm=${DISAGG_EXECUTOR_MASKS:-}; [ "$part" = surface_sched ] && xm=0
  DISAGG_SWITCH_INTERVAL_US=$swi DISAGG_EXECUTOR_MASKS=$xm \
    DISAGG_TRACE=$WORK/$part/trace \
    KINDS=${KINDS:-"plain json sampled"} ROUNDS=${ROUNDS:-"1 2 3"} \
    timeout "${T_PART:-560}" bash bench/request_surface.sh "$WORK/$part" "$SURFACE_MODEL" \
    > "$WORK/$part.log" 2>&1
  note "$(stamp) $part rc=$? (switch interval: ${swi:-default 5000} us, executor masks: ${xm:-default 1})"
  grep -E "^round|^n=|late compiles" "$WORK/$part.log" | sed "s/^/  $part /" | tee -a "$SUMMARY"
  python3 bench/grammar_gaps.py "$WORK/$part/trace" --json "$WORK/$part/grammar_gaps.json" \
    2>&1 | sed "s/^/  $part gaps /" | tee -a "$SUMMARY"
done

for kv in bf16 fp8; do
  has "tiers_$kv" || continue
  extra=${EXTRA:-}; [ "$kv" = fp8 ] && extra="$extra --kv-cache-dtype fp8_e4m3"
  EXTRA=$extra timeout "${T_PART:-560}" bash bench/kv_tiers.sh "$WORK/tiers_$kv" \
    > "$WORK/tiers_$kv.log" 2>&1
  note "$(stamp) tiers ($kv pages) rc=$?"
  tail -8 "$WORK/tiers_$kv.log" | sed "s/^/  $kv /" | tee -a "$SUMMARY"
done
note "$(stamp) done"
