#!/usr/bin/env bash
# Prepares, on a machine with a package registry, what a lent GPU machine (no registry, no
# libfabric headers; docs GPU notes) needs to run this tree's benches, in paths git ignores:
#   .whl/          cp312 manylinux wheels: msgspec, pyzmq, cffi, pycparser, xgrammar and the
#                  imports (apache-tvm-ffi, pydantic and its parts, typing-extensions; NOTES),
#                  pytest-asyncio (the image has pytest but not it; the gpu tests need it)
#   .fabinc/rdma/  libfabric's headers (Debian's libfabric-dev), for `python3 -m
#                  disagg.fabric.build` there with DISAGG_FABRIC_INCLUDE=$PWD/.fabinc
#   .device/smodel/ the Qwen3-8B shape's config.json (eos 2) with the embedded model's tokenizer
#                  files: MODEL_DIR for bench/request_surface.sh and bench/grammar_host.py
# then name them in the device call's carry ([".whl", ".fabinc", ".device"]) and start the
# command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
# Idempotent: what exists is kept (remove a directory to rebuild it).
#   bash bench/device_prep.sh            (in the repository root, after `make install`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for d in .whl .fabinc .device; do
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
done

if [ ! -d .whl ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d .whl msgspec pyzmq cffi pycparser \
    "xgrammar==$("$PY" -c 'import importlib.metadata as m; print(m.version("xgrammar"))')" \
    apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions \
    pytest-asyncio
fi

if [ ! -d .fabinc/rdma ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download libfabric-dev > /dev/null && dpkg -x libfabric-dev_*.deb root)
  mkdir -p .fabinc && cp -r "$tmp"/root/usr/include/rdma .fabinc/
  rm -rf "$tmp"
fi

if [ ! -f .device/smodel/tokenizer.json ]; then
  mkdir -p .device/smodel
  "$PY" - <<'EOF'
import json, shutil, sys
from pathlib import Path

sys.path.append("bench")  # after site-packages: bench/kernels.py would shadow `kernels`
from experiment_engine import QWEN3_8B
from disagg.model.default import default_model_dir

src, out = default_model_dir(progress=False), Path(".device/smodel")
for f in src.iterdir():
    if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",):
        shutil.copy(f, out / f.name)
cfg = dict(QWEN3_8B, eos_token_id=2)  # the embedded tokenizer's end of text
(out / "config.json").write_text(json.dumps(cfg, indent=1))
print("smodel:", sorted(p.name for p in out.iterdir()))
EOF
fi
ls .whl .fabinc/rdma | head -40
