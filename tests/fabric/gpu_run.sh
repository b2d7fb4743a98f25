#!/usr/bin/env bash
# The GPU transfer runs of docs/BENCHMARKS.md "## Fabric" in one device call (nvidia-h200-x2):
#   bash tests/fabric/gpu_run.sh OUTDIR      (carry .whl and .device/fabric-include)
# cuda-ipc sweep next to a peer-copy ceiling, legacy-IPC memory, staged fabric (shm, tcp),
# then prefill(GPU0) -> decode(GPU1) node pairs checked against a mixed node.
set -u
OUT=${1:?usage: gpu_run.sh OUTDIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/msgspec*.whl .whl/pyzmq*.whl .whl/cffi*.whl .whl/pycparser*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
DISAGG_FABRIC_INCLUDE=$PWD/.device/fabric-include python3 -m disagg.fabric.build || exit 1
B="python3 -m disagg.bench fabric --no-pin --json"
timeout 80 $B --backend cuda-ipc --page-sizes 262144,1048576,4194304,16777216 \
  --total-bytes 1073741824 --rounds 5 --copy auto,kernel:32,ce,loop \
  > "$OUT/cuda_ipc.json" 2> "$OUT/cuda_ipc.err"; echo "cuda-ipc rc=$?"; cat "$OUT/cuda_ipc.err"
timeout 130 python3 -m pytest -q -p no:cacheprovider -m "gpu or multi_gpu" \
  tests/procs/test_gpu_transfer.py --basetemp=/tmp/gt > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -n 25 "$OUT/pytest.log"
for pv in shm tcp; do
  timeout 40 $B --backend staged --provider $pv --page-sizes 1048576 --total-bytes 268435456 \
    --rounds 3 > "$OUT/staged_$pv.json" 2> "$OUT/staged_$pv.err"; echo "staged $pv rc=$?"
  cat "$OUT/staged_$pv.err"
done
timeout 30 $B --backend cuda-ipc --memory malloc --page-sizes 1048576 --total-bytes 1073741824 \
  --rounds 3 > "$OUT/cuda_ipc_malloc.json" 2> "$OUT/cuda_ipc_malloc.err"
echo "malloc rc=$?"; cat "$OUT/cuda_ipc_malloc.err"
tar czf "$OUT/logs.tgz" -C /tmp gt 2>/dev/null
exit 0
