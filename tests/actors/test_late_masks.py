"""``late_masks.mask_threads``: how many threads one executor fills grammar masks on."""

from __future__ import annotations

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
