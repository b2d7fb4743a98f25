"""The prefill messenger's context write (issue 18, the exposed transfer tail): without MTP the
decoder never reads the context row, so the write (one unit it counts) goes out as a marker
right after the last layer of the job's last chunk, not after the step's end (the executor's
reply, the scheduler's hop); with MTP it carries the hidden row and waits for the step's end.
A real PrefillMessenger (its zmq sockets) over a transfer engine that records the writes; and
where a job's queue clock starts (the frame's arrival)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from disagg.actors.prefill_messenger.prefill_jobs import Job
from disagg.actors.prefill_messenger.prefill_messenger import PrefillMessenger
from disagg.fabric.descriptor import MemoryDescriptor
from disagg.protocol.inproc import ChunkInfo, StepAnnounce, StepDone
from disagg.protocol.peer import KVLayoutDesc, PrefillRequest

LAYERS = 3
PAGE = 4


def layout(**kw: Any) -> KVLayoutDesc:
    base = dict(num_layers=LAYERS, num_pages=32, num_kv_heads=2, page_size=PAGE, head_dim=8,
                dtype="float32", element_size=4, hidden_size=16)
    base.update(kw)
    return KVLayoutDesc(**base)  # type: ignore[arg-type]


@dataclass
class Region:
    descriptor: MemoryDescriptor
    length: int


class RecordingTransfer:
    """What the messenger uses of the transfer engine; every write is recorded, done at once."""

    lanes = 1
    timeout_s = 30.0
    writes_sent = 0
    bytes_sent = 0

    def __init__(self) -> None:
        self.writes: list[tuple[str, int]] = []  # (destination name, units)

    def register(self, tensor: torch.Tensor, fd: Any = None, access: str = "both") -> Region:
        n = tensor.numel() * tensor.element_size()
        return Region(MemoryDescriptor(backend="fabric", provider="tcp", address=b"a", base=0,
                                       length=n, key=0), n)

    def context_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        return torch.zeros(rows, row_bytes, dtype=torch.uint8)

    def probes(self) -> RecordingTransfer:
        return self  # ownership nonces go out on the same (recording) engine here

    def write(self, src: Any, dst: str, runs: Any, key: int, timeout: float | None = None,
              counted: bool = True) -> list[asyncio.Future[None]]:
        self.writes.append((dst, int(runs.units.sum())))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return [fut]


class Counter:
    def read(self) -> int:
        return 0


class Poller:  # the layer poller thread's place: the test reports layers itself
    def follow(self, step_id: int, base: int) -> None:
        pass


async def one_step(lay: KVLayoutDesc, prompt: int, chunk: int, min_tokens: int = 0
                   ) -> tuple[list[list[tuple[str, int]]], RecordingTransfer]:
    """A job of ``prompt`` tokens computed in steps of ``chunk`` tokens: the writes recorded
    after each step's first layer, its last layer (as the layer poller reports them) and its
    StepDone, in order; ``min_tokens``: the messenger's ``layerwise_min_tokens``."""
    ctx = zmq.asyncio.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://sched")
    b.connect("inproc://sched")
    transfer = RecordingTransfer()
    kv = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    m = None
    try:  # a failure closes the sockets too (an open one's context hangs the suite in its GC)
        m = PrefillMessenger("tcp://127.0.0.1:0", ctx, b, transfer, lay, [kv],  # type: ignore[arg-type]
                             Counter(), vocab_size=100, max_jobs=4,
                             layerwise_min_tokens=min_tokens)
        m.poller = Poller()  # type: ignore[assignment]
        n_pages = -(-prompt // PAGE)
        req = PrefillRequest(request_id="r", key=5, prompt_ids=list(range(prompt)),
                             dst_pages=list(range(n_pages)), dst_layout=lay, dst_kv=b"",
                             dst_ctx=b"", ctx_offset=0, timeout_s=60.0)
        m.jobs[1] = Job(1, b"peer", req, ["kv"], "ctx")
        m.writes.add(m.jobs[1])
        m.ctx_of[1] = m.ctx_free.pop()
        m._carry_out(m.life.accept(1, b"peer", n_pages, 60.0, 60.0, time.monotonic()))
        src = list(range(10, 10 + n_pages))
        seen: list[list[tuple[str, int]]] = []
        enc = msgspec.msgpack.Encoder()
        for step, start in enumerate(range(0, prompt, chunk)):
            count = min(chunk, prompt - start)
            await a.send(enc.encode(StepAnnounce(step, 0, [ChunkInfo(1, start, count, prompt,
                                                                     src)])))
            await m._from_scheduler()
            m.writes.on_layers(step, 1)  # the poller saw the step's first layer
            seen.append(list(transfer.writes))
            m.writes.on_layers(step, LAYERS)  # ... and its last
            seen.append(list(transfer.writes))
            last = start + count == prompt
            await a.send_multipart([enc.encode(StepDone(step, True, [1] if last else [])),
                                    bytes(lay.context_bytes)] if last else
                                   [enc.encode(StepDone(step, True, []))])
            await m._from_scheduler()
            seen.append(list(transfer.writes))
        return seen, transfer
    finally:
        if m is not None:
            m.close()
        ctx.destroy(linger=0)
        ctx.term()


@pytest.mark.parametrize("chunk", [12, 5])
def test_context_marker_goes_out_with_the_last_layer(chunk: int) -> None:
    seen, transfer = asyncio.run(one_step(layout(), 12, chunk))
    after_last_layer = seen[-2]
    assert len(seen) == 3 * -(-12 // chunk)
    # the decoder's count completes before the step's end is known here
    assert [w for w in after_last_layer if w[0] == "ctx"] == [("ctx", 1)]
    # nothing of the context before the last chunk's last layer, and no second write after
    assert all(w[0] != "ctx" for s in seen[:-2] for w in s)
    assert [w for w in transfer.writes if w[0] == "ctx"] == [("ctx", 1)]
    kv_units = sum(u for d, u in transfer.writes if d == "kv")
    assert kv_units == LAYERS * 3  # 12 tokens: 3 pages of every layer


def test_steps_ship_layer_by_layer_unless_short() -> None:
    """A step of at least ``layerwise_min_tokens`` prompt tokens ships each layer as it
    finishes; a shorter one ships nothing until its last layer, then every layer in one write
    (the same units)."""
    seen, transfer = asyncio.run(one_step(layout(), 12, 12, min_tokens=12))
    assert seen[0] == [("kv", 3)]  # layer 0's three pages, while layers 1.. still compute
    assert transfer.writes == [("kv", 3), ("kv", 3), ("kv", 3), ("ctx", 1)]
    seen, transfer = asyncio.run(one_step(layout(), 12, 12, min_tokens=13))
    assert seen[0] == []
    assert transfer.writes == [("kv", 3 * LAYERS), ("ctx", 1)]


def test_mtp_context_waits_for_the_hidden_row() -> None:
    seen, transfer = asyncio.run(one_step(layout(spec_method="mtp"), 12, 12))
    assert all(w[0] != "ctx" for w in seen[-2])  # its row is only known at StepDone
    assert [w for w in seen[-1] if w[0] == "ctx"] == [("ctx", 1)]


def test_a_jobs_queue_clock_starts_when_its_frame_arrived(monkeypatch) -> None:
    """The prefiller's queue time (PrefillDone's queue_s) starts when the request's frame was
    read, before its checks (decoding, bounds, descriptors): that work is the prefiller's, not
    the transfer tail's (the decoder's exposed transfer is its KV wait minus queue and
    compute)."""
    import disagg.remote.admission as admission

    monkeypatch.setattr(admission, "descriptor_problem", lambda *a: None)
    monkeypatch.setattr(admission, "endpoints", lambda kv, ctx, lanes: ([ctx], None))

    class Transfer(RecordingTransfer):
        def decode_descriptor(self, raw: bytes) -> MemoryDescriptor:
            return MemoryDescriptor(backend="fabric", provider="tcp", address=b"a", base=0,
                                    length=1 << 20, key=0)

    async def run() -> float:
        ctx = zmq.asyncio.Context()
        b = ctx.socket(zmq.PAIR)
        lay = layout()
        kv = torch.zeros(lay.total_bytes, dtype=torch.uint8)
        m = PrefillMessenger("tcp://127.0.0.1:0", ctx, b, Transfer(), lay, [kv],  # type: ignore[arg-type]
                             Counter(), vocab_size=100, max_jobs=4)
        monkeypatch.setattr(m.gate, "status", lambda conn, addresses, now: "owned")
        try:
            req = PrefillRequest(request_id="r", key=5, prompt_ids=list(range(12)),
                                 dst_pages=[0, 1, 2], dst_layout=lay, dst_kv=b"", dst_ctx=b"",
                                 ctx_offset=0, timeout_s=60.0)
            arrived = time.monotonic() - 5.0
            await m._accept(b"peer", req, (b"peer", 7), arrived)
            (job,) = m.life.jobs.values()
            return job.accepted_at - arrived
        finally:
            m.close()
            b.close()
            ctx.term()

    assert asyncio.run(run()) == 0.0
