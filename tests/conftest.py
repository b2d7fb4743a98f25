"""Shared fixtures: tiny random Hugging Face models of each supported architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tinymodels import make_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# at most two threads, and the cores shared among pytest-xdist's worker processes (each test
# file runs in one of them, make test's PYTEST_WORKERS): idle OpenMP threads spin
WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {k: make_tiny_model(k, root / k) for k in ("llama", "qwen2", "qwen3")}


