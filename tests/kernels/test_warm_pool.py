"""The parallel warm-up's pool (disagg.kernels.warm_pool): each kernel variant compiled by one
thread however many jobs launch it at once, jobs run side by side, a failed job reported and
not fatal, Triton's hooks put back afterwards. Triton's launch path is played by FakeTriton (a
real launch needs a GPU); the hooks are installed into the real ``triton.knobs``."""

from __future__ import annotations

import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from disagg.engine.warmup import warm_threads
from disagg.kernels.warm_pool import CompileOnce, compile_hooks, run_parallel


class FakeTriton:
    """``JITFunction.run`` as the hooks see it: a variant missing from the function's in-memory
    cache calls the cache hook, is compiled (or loaded when on 'disk'), cached, and the
    post-compile hook called. Nothing is locked, as in Triton."""

    def __init__(self, before: Any, after: Any, compile_s: float = 0.05) -> None:
        self.before, self.after, self.compile_s = before, after, compile_s
        self.memory: set[tuple[str, int]] = set()
        self.disk: set[tuple[str, int]] = set()
        self.compiles: Counter[tuple[str, int]] = Counter()
        self.loads: Counter[tuple[str, int]] = Counter()
        self.launches = 0
        self.fns = {name: SimpleNamespace(jit_function=object()) for name in "ABC"}

    def launch(self, name: str, key: int) -> None:
        v = (name, key)
        if v not in self.memory:
            if self.before(key=key, fn=self.fns[name], repr=f"{name}[{key}]"):
                return  # Triton then neither compiles nor launches
            if v in self.disk:
                self.loads[v] += 1
            else:
                time.sleep(self.compile_s)
                self.compiles[v] += 1
                self.disk.add(v)
            self.memory.add(v)
            self.after(key=key, fn=self.fns[name])
        self.launches += 1


VARIANTS = [("A", 1), ("A", 16), ("B", 1)]


def launch_at_once(triton: FakeTriton, threads: int) -> None:
    barrier = threading.Barrier(threads, timeout=10)

    def job() -> None:
        barrier.wait()
        for name, key in VARIANTS:
            triton.launch(name, key)

    workers = [threading.Thread(target=job) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
        assert not w.is_alive()


def test_without_compile_once_jobs_launching_one_variant_at_once_each_compile_it():
    triton = FakeTriton(lambda **_: False, lambda **_: None)
    launch_at_once(triton, 6)
    assert sum(triton.compiles.values()) > len(VARIANTS)  # the waste CompileOnce removes


def test_compile_once_compiles_each_variant_once_and_every_launch_runs():
    once = CompileOnce()
    triton = FakeTriton(once.before, once.after)
    launch_at_once(triton, 6)
    assert triton.compiles == Counter({v: 1 for v in VARIANTS})
    assert triton.launches == 6 * len(VARIANTS)  # nobody skipped a launch
    assert sorted(once.compiled) == ["A[16]", "A[1]", "B[1]"]
    assert once.waited > 0  # the others took it from disk after its compile
    assert all(triton.loads[v] <= 5 for v in VARIANTS)


def test_a_thread_failing_mid_compile_releases_its_waiters():
    once = CompileOnce(wait_s=60)
    fn = SimpleNamespace(jit_function=object())
    started, done = threading.Event(), threading.Event()

    def failing() -> None:
        once.before(key=7, fn=fn, repr="F[7]")  # starts the compile, never reaches after()
        started.set()
        time.sleep(0.1)
        once.release()  # run_parallel's job wrapper does this when the job raises

    def waiter() -> None:
        started.wait(10)
        assert once.before(key=7, fn=fn) is False
        done.set()

    threads = [threading.Thread(target=failing), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    assert done.wait(10), "the waiter was not released"
    for t in threads:
        t.join(10)
    assert once.waited == 1 and once.compiled == ["F[7]"]


def test_jobs_run_side_by_side_and_a_failed_job_is_reported_not_fatal():
    barrier = threading.Barrier(4, timeout=10)
    ran: list[str] = []

    def meet(name: str) -> None:
        barrier.wait()  # only passes when all four run at once
        ran.append(name)

    def broken() -> None:
        raise RuntimeError("no such kernel")

    jobs = [(f"job {i}", lambda i=i: meet(f"job {i}")) for i in range(4)] + [("broken", broken)]
    report = run_parallel(jobs, threads=4)
    assert sorted(ran) == [f"job {i}" for i in range(4)]
    assert report.jobs == 5 and report.failed == ["broken: no such kernel"]


def test_triton_hooks_are_installed_for_the_warm_up_and_put_back():
    knobs = pytest.importorskip("triton").knobs
    seen: list[Any] = []
    previous = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    sentinel = lambda **_: False  # noqa: E731 - someone else's hook, before the warm-up
    knobs.runtime.jit_cache_hook = sentinel
    try:
        run_parallel([("look", lambda: seen.append((knobs.runtime.jit_cache_hook,
                                                    knobs.runtime.jit_post_compile_hook)))], 1)
        (before, after), = seen
        assert isinstance(before.__self__, CompileOnce) and after.__self__ is before.__self__
        assert knobs.runtime.jit_cache_hook is sentinel
        assert knobs.runtime.jit_post_compile_hook is previous[1]
        with compile_hooks(CompileOnce()) as installed:
            assert installed
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = previous


def test_a_warm_up_past_its_deadline_raises():
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="'stuck' still running"):
            run_parallel([("stuck", lambda: release.wait(30))], 1, timeout_s=0.2)
    finally:
        release.set()


def test_warm_threads_share_the_cores_among_executors():
    assert warm_threads(1, cores=16) == 16
    assert warm_threads(2, cores=16) == 8
    assert warm_threads(1, cores=64) == 16  # at most MAX_THREADS
    assert warm_threads(4, cores=2) == 1
