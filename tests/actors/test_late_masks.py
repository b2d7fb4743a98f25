"""``late_masks.mask_threads``: how many threads one executor fills grammar masks on."""

from __future__ import annotations

import concurrent.futures
import importlib
from types import SimpleNamespace

from disagg.actors.executor import late_masks


def cfg(threads: int, executors: int):
    return SimpleNamespace(scheduler=SimpleNamespace(grammar_threads=threads),
                           devices=["cuda:0"] * executors)


def test_default_threads_are_shared_among_the_nodes_executors(monkeypatch):
    monkeypatch.setattr(late_masks, "default_threads", lambda: 8)
    assert late_masks.mask_threads(cfg(0, 1)) == 8
    assert late_masks.mask_threads(cfg(0, 2)) == 4
    assert late_masks.mask_threads(cfg(0, 8)) == 1
    assert late_masks.mask_threads(cfg(0, 16)) == 1  # never none


def test_grammar_threads_given_are_each_executors(monkeypatch):
    monkeypatch.setattr(late_masks, "default_threads", lambda: 8)
    assert late_masks.mask_threads(cfg(3, 1)) == 3
    assert late_masks.mask_threads(cfg(3, 4)) == 3


def test_warm_imports_xgrammar_on_a_thread_of_its_own(monkeypatch):
    """``OwnMasks.warm``: xgrammar is imported off the step loop, on the thread that loads
    the grammar definitions after it; an import that fails is no error (the executor serves
    on)."""
    import threading

    seen: list[tuple[str, str]] = []

    def fake_import(name: str):
        seen.append((name, threading.current_thread().name))
        raise ImportError("not here")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    own = late_masks.OwnMasks(1)
    done = own.warm()
    concurrent.futures.wait([done], timeout=10)
    assert done.done() and isinstance(done.exception(), ImportError)
    assert [name for name, _ in seen] == ["xgrammar"]
    assert seen[0][1].startswith("grammar-define")  # the definitions' loader
    own.close()
