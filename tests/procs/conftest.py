"""Process tests: every test here starts node or executor processes (the ``procs`` marker,
added to each; ``-m "not procs"`` runs the unit tests alone, in seconds).

Files whose tests leave a node as they found it (nothing in flight, every page free, Stats
read as deltas, prompts of their own) share one mixed node and its HTTP gateway for the
session rather than each starting its own; a test that kills, stops or reconfigures a node
starts its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodes import SHARED_MAX_LEN, SHARED_MODEL, SHARED_PAGES, chat_model, gateway, node, running
from tinymodels import make_tiny_model

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.procs)


@pytest.fixture(scope="session")
def chat_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with a word tokenizer and a chat template (what the gateway needs);
    read-only: tests write nothing into it."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("chat-llama") / "llama")
    chat_model(path)
    return path


@pytest.fixture(scope="session")
def shared_node(chat_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of a mixed node serving ``chat_llama``: ``SHARED_PAGES`` pages,
    ``--max-model-len SHARED_MAX_LEN``, the other flags at their defaults."""
    addr, proc = node("mixed", chat_llama, tmp_path_factory.mktemp("shared-node"),
                      "--num-pages", str(SHARED_PAGES), "--max-model-len", str(SHARED_MAX_LEN))
    with running([proc]):
        yield addr


@pytest.fixture(scope="session")
def shared_gateway(shared_node: str, chat_llama: Path) -> Iterator[Any]:
    """The OpenAI gateway (in the test process) in front of ``shared_node``, serving
    ``SHARED_MODEL``."""
    with gateway(shared_node, chat_llama, SHARED_MODEL) as gw:
        yield gw
