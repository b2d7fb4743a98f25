"""Warm-up steps run several at a time, so their Triton kernels compile in parallel.

A cold start compiles a few dozen kernel variants, one after another when the warm-ups run in
turn (each 0.3-1 s on an H200's host). ``run_parallel`` runs independent warm-up jobs (eager
forwards: one per decode bucket, per decode split count, the prefill steps) in a thread pool,
each on a CUDA stream of its own: Triton's compile releases the GIL in its native passes and
ptxas is a subprocess, so the compiles overlap.

``CompileOnce`` keeps each variant's compile to one thread: two jobs launching the same variant
at once would both compile it (Triton has no lock). Through Triton's public hooks (the cache hook
runs before a compile, the post-compile hook after), a second thread waits for the first
thread's compile and then takes the variant from Triton's on-disk cache (milliseconds), never
compiling it again.

Nothing here decides what to warm: ``disagg.engine.warmup`` lists the jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

COMPILE_WAIT_S = 300.0  # a thread waits at most this long for another's compile of a variant
WARM_TIMEOUT_S = 600.0  # the whole parallel warm-up


class CompileOnce:
    """Triton's two compile hooks, making one thread compile each kernel variant.

    ``before`` (``knobs.runtime.jit_cache_hook``) is called by a thread about to compile a
    variant not in its function's in-memory cache; ``after``
    (``knobs.runtime.jit_post_compile_hook``) once the variant is compiled (or loaded from the
    on-disk cache). A variant's first ``before`` lets its thread compile; a ``before`` while that
    compile runs waits for its ``after`` (at most ``wait_s``), then lets its own thread go on,
    which now finds the variant on disk. ``release`` frees the waiters of a thread whose job
    failed mid-compile."""

    def __init__(self, wait_s: float = COMPILE_WAIT_S) -> None:
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, tuple[threading.Event, int]] = {}  # variant -> (done, thread)
        self._seen: set[Hashable] = set()
        self.compiled: list[str] = []  # each variant compiled (or loaded) first, by its repr
        self.waited = 0  # launches that waited for another thread's compile of their variant

    @staticmethod
    def variant(key: Any, fn: Any) -> Hashable:
        """A variant's identity: its JIT function and its specialization key."""
        return (id(getattr(fn, "jit_function", fn)), key)

    def before(self, *, key: Any, fn: Any, repr: str = "", **_: Any) -> bool:
        v = self.variant(key, fn)
        with self._lock:
            entry = self._inflight.get(v)
            if entry is None:
                if v not in self._seen:
                    self._seen.add(v)
                    self.compiled.append(repr or str(key))
                    self._inflight[v] = (threading.Event(), threading.get_ident())
                return False  # compile (or load what another thread put on disk)
            self.waited += 1
        if not entry[0].wait(self.wait_s):
            log.warning("waited %.0f s for another thread's compile of %s; compiling it here",
                        self.wait_s, repr or key)
        return False  # never skip: Triton would then not launch the kernel

    def after(self, *, key: Any, fn: Any, **_: Any) -> None:
        with self._lock:
            entry = self._inflight.pop(self.variant(key, fn), None)
        if entry is not None:
            entry[0].set()

    def release(self) -> None:
        """Free whoever waits on a compile the calling thread started and never finished."""
        me = threading.get_ident()
        with self._lock:
            mine = [v for v, (_, t) in self._inflight.items() if t == me]
            events = [self._inflight.pop(v)[0] for v in mine]
        for e in events:
            e.set()


@contextmanager
def compile_hooks(once: CompileOnce) -> Iterator[bool]:
    """Install ``once`` as Triton's cache and post-compile hooks (yields False where this
    Triton has no such hooks, or no Triton), and put back the previous hooks afterwards."""
    try:
        from triton import knobs
    except ImportError:
        yield False
        return
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        yield False
        return
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = once.before, once.after
    try:
        yield True
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after


@dataclass
class WarmReport:
    """What a parallel warm-up did."""

    jobs: int
    seconds: float
    compiled: list[str] = field(default_factory=list)  # variants compiled or loaded, once each
    waited: int = 0  # launches that waited for another job's compile of their variant
    failed: list[str] = field(default_factory=list)  # jobs that raised: "name: error"


def run_parallel(jobs: Sequence[tuple[str, Callable[[], None]]], threads: int,
                 device: Any = None, timeout_s: float = WARM_TIMEOUT_S) -> WarmReport:
    """Run ``jobs`` (name, callable) at most ``threads`` at a time under ``CompileOnce``; on a
    CUDA ``device`` each in its own thread on a stream of its own (made current in the thread,
    with the device), under inference mode, then every stream synchronized. A job that raises
    is logged and reported, never fatal (the sequential warm-ups after it compile whatever it
    missed). Raises ``TimeoutError`` past ``timeout_s``."""
    import torch

    once = CompileOnce()
    cuda = device is not None and torch.device(device).type == "cuda"
    local = threading.local()  # one stream per thread (each stream gets its cuBLAS workspace)

    def run(job: Callable[[], None]) -> None:
        try:
            with torch.inference_mode():
                if not cuda:
                    job()
                    return
                with torch.cuda.device(device):
                    stream = getattr(local, "stream", None)
                    if stream is None:
                        stream = local.stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        job()
                    stream.synchronize()
        finally:
            once.release()

    t0 = time.monotonic()
    failed: list[str] = []
    with compile_hooks(once):
        pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="warm")
        try:
            futures = [(name, pool.submit(run, job)) for name, job in jobs]
            deadline = t0 + timeout_s
            for name, fut in futures:
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    raise TimeoutError(f"parallel warm-up not done within {timeout_s:.0f} s "
                                       f"(job {name!r} still running)") from None
                except Exception as e:  # noqa: BLE001 - the sequential warm-ups retry it
                    log.warning("parallel warm-up job %s failed: %s", name, e)
                    failed.append(f"{name}: {e}")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    if cuda:
        torch.cuda.synchronize(device)
    return WarmReport(len(jobs), time.monotonic() - t0, once.compiled, once.waited, failed)
