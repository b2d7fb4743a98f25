"""The layer contract: the pure modules load without the native and heavy libraries, and
docs/ARCHITECTURE.md's "Layers" is the contract `lint-imports` checks (pyproject.toml)."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import disagg.remote

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]

# What a pure module must load without: sockets, asyncio, the tokenizer library, the libfabric
# build (the compiled cffi module and cffi itself), torch and Triton (so no CUDA).
BLOCKED = ("zmq", "asyncio", "tokenizers", "disagg.fabric._libfabric_cffi", "cffi", "torch",
           "triton")
PURE = sorted(f"disagg.remote.{m.name}" for m in pkgutil.iter_modules(disagg.remote.__path__)) + [
    "disagg.serving.routing", "disagg.serving.admission", "disagg.serving.http_limits",
    "disagg.serving.health", "disagg.serving.tenants"]

# Imports each module with the blocked ones refused; prints {module: error} as JSON. One
# process serves them all: a blocked module never loads, so no module hides another's need.
IMPORT_BLOCKED = """
import importlib, json, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked: {name}")
        return None

for name in list(sys.modules):  # nothing blocked may be loaded already (e.g. by site)
    if any(name == b or name.startswith(b + ".") for b in BLOCKED):
        del sys.modules[name]
sys.meta_path.insert(0, Block())
errors = {}
for module in MODULES:
    try:
        importlib.import_module(module)
    except Exception as e:
        errors[module] = f"{type(e).__name__}: {e}"
print(json.dumps(errors))
"""


def _import_with(modules: list[str], blocked: tuple[str, ...]) -> dict[str, str]:
    """module -> why it did not import (absent when it did), in a fresh interpreter."""
    script = f"BLOCKED = {blocked!r}\nMODULES = {modules!r}\n" + IMPORT_BLOCKED
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def pure_import_errors() -> dict[str, str]:
    return _import_with(PURE, BLOCKED)


def test_the_blocker_blocks():
    errors = _import_with(["disagg.fabric.lib", "disagg.model.tokenizer", "disagg.model.ops"],
                          BLOCKED)
    assert "the libfabric cffi module is not built" in errors["disagg.fabric.lib"]
    assert "blocked: tokenizers" in errors["disagg.model.tokenizer"]
    assert "blocked: torch" in errors["disagg.model.ops"]


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_imports_without_sockets_tokenizers_libfabric_or_torch(
        module: str, pure_import_errors: dict[str, str]):
    assert module not in pure_import_errors, pure_import_errors[module]


def test_the_decode_side_imports_without_tokenizers():
    assert _import_with(["disagg.actors.scheduler.decode_scheduler"], ("tokenizers",)) == {}


def _documented_layers() -> list[str]:
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = arch[arch.index("## Layers"):]
    block = section[section.index("```") + 3:]
    block = block[block.index("\n") + 1:block.index("```")]
    return [re.split(r"\s{2,}", line.strip())[0] for line in block.splitlines() if line.strip()]


def test_the_architecture_lists_the_layers_the_contract_checks():
    (layers,) = [c["layers"] for c in CONTRACTS["contracts"] if c["type"] == "layers"]
    assert _documented_layers() == [layer.replace("(", "").replace(")", "")
                                    for layer in layers]


def test_lint_imports_keeps_every_contract():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
