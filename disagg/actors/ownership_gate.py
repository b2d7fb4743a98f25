"""The prefiller's ownership gate: a PrefillRequest is served only once the connection that sent
it proved it owns the endpoints it names (``disagg.remote.ownership``): a random nonce is
written into the challenge area it advertised, through every lane, and must come back over the
same connection. Requests wait here meanwhile (no job slot, no page); one check per connection
at a time, at most ``MAX_CHECKS`` under way in all, each within the ownership timeout."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import torch

from disagg.actors.transfer import TransferEngine
from disagg.protocol.peer import Challenge, PrefillFailed, PrefillRequest
from disagg.remote.ownership import (
    NONCE_BYTES,
    SLOT_BYTES,
    Check,
    Conn,
    NonceSlots,
    OwnershipBook,
    lane_weights,
    nonce_offset,
)
from disagg.remote.transfer_plan import Runs, Write

log = logging.getLogger(__name__)

NONCE_SOURCE_SLOTS = 4096  # nonces being written (a failed write's slot rests 10 min)
MAX_CHECKS = 64  # ownership checks under way at once, all connections


class OwnershipGate:
    def __init__(self, transfer: TransferEngine, timeout_s: float, max_parked: int,
                 reply: Callable[[bytes, Any], Awaitable[None]],
                 accept: Callable[[bytes, PrefillRequest, Conn], Awaitable[None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]):
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.max_parked = max_parked  # requests of one connection waiting for its check
        self.reply, self.accept, self.spawn = reply, accept, spawn
        # nonces are written from their own source buffer (never a context row)
        self.nonce_buf = transfer.context_buffer(NONCE_SOURCE_SLOTS, SLOT_BYTES)
        self.nonce_region = transfer.register(self.nonce_buf.view(-1), access="source")
        self.nonce_slots = NonceSlots(NONCE_SOURCE_SLOTS)
        self.owners = OwnershipBook()
        self.parked: dict[Conn, list[tuple[bytes, PrefillRequest]]] = {}  # waiting for a check
        self.answers: dict[tuple[Conn, int], asyncio.Future[bytes]] = {}

    def status(self, conn: Conn, endpoints: frozenset[bytes], now: float) -> str:
        """``owned``, ``refused`` (failed a check a while ago) or ``unknown`` (check first)."""
        return self.owners.status(conn, endpoints, now)

    def answered(self, conn: Conn, check_id: int, nonce: bytes) -> None:
        """A ChallengeAnswer arrived on ``conn``."""
        fut = self.answers.get((conn, check_id))
        if fut is not None and not fut.done():
            fut.set_result(nonce)

    def withdraw(self, conn: Conn, request_id: str) -> None:
        """Drop a parked request (aborted): it was never accepted, nothing of it is written."""
        parked = self.parked.get(conn, [])
        for item in [p for p in parked if p[1].request_id == request_id]:
            parked.remove(item)

    def disconnected(self, fd: int) -> None:
        for conn in self.owners.forget(fd):
            self.parked.pop(conn, None)  # nobody to answer

    def waiting(self) -> int:
        return sum(len(p) for p in self.parked.values())

    async def park(self, peer: bytes, conn: Conn, req: PrefillRequest, dst_ctx: Any,
                    lanes: list[Any]) -> None:
        """Hold a request until its connection proved it owns the endpoints named (one check
        per connection at a time; no job slot or page is taken meanwhile)."""
        parked = self.parked.get(conn, [])
        busy = None
        if len(parked) >= self.max_parked:
            busy = "too many requests of this decoder wait for its ownership check"
        elif conn not in self.owners.checks:
            slot = (self.nonce_slots.take(time.monotonic())
                    if len(self.owners.checks) < MAX_CHECKS else None)
            if slot is None:
                busy = "too many ownership checks under way"
            else:
                check = self.owners.start(conn, frozenset(d.address for d in lanes), len(lanes))
                self.spawn(self._check(peer, check, slot, req, dst_ctx, lanes))
        if busy:
            await self.reply(peer, PrefillFailed(req.request_id, "overloaded", busy))
            return
        self.parked.setdefault(conn, []).append((peer, req))

    async def _check(self, peer: bytes, check: Check, slot: int, req: PrefillRequest,
                     dst_ctx: Any, lanes: list[Any]) -> None:
        """Write the nonce through every lane, ask the connection for it back, then serve or
        refuse the requests that waited; all within the ownership timeout."""
        deadline = time.monotonic() + self.timeout_s
        futures: list[asyncio.Future[None]] = []
        answer = None
        written = False
        timed_out = False
        try:
            nonce = torch.frombuffer(bytearray(check.nonce), dtype=torch.uint8)
            self.nonce_buf[slot, :len(check.nonce)] = nonce.to(self.nonce_buf.device)
            try:
                for i, (lane, units) in enumerate(zip(lanes, lane_weights(len(lanes)), strict=True)):
                    w = Write(slot * SLOT_BYTES + i * NONCE_BYTES,
                              nonce_offset(dst_ctx.length, req.challenge_slot, i), NONCE_BYTES,
                              units)
                    # not KV: Stats.kv_writes_sent / kv_bytes_sent count KV only
                    futures += self.transfer.write(self.nonce_region, lane, Runs.of([w]),
                                                   req.challenge_key, timeout=self.timeout_s,
                                                   counted=False)
            finally:  # every posted write settles by the timeout
                results = await asyncio.gather(*futures, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            written = True
            fut = asyncio.get_running_loop().create_future()
            self.answers[(check.conn, check.id)] = fut
            await self.reply(peer, Challenge(check.id, len(lanes), req.request_id))
            answer = await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - any failure is a failed check
            timed_out = isinstance(e, TimeoutError)
            log.warning("ownership check %d of a decoder failed: %s", check.id,
                        e.__class__.__name__ + (f": {e}" if str(e) else ""))
        finally:
            self.answers.pop((check.conn, check.id), None)
            now = time.monotonic()
            self.nonce_slots.give(slot, written, now)
        # a write refused at once (say the attempt's window closed) proves nothing either way:
        # only that request is refused; a wrong or missing answer, or a write that never
        # completed, refuses the connection's requests naming those endpoints for a while
        # an empty answer: the decoder abstained, the request named was aborted meanwhile (its
        # registration may have closed before the nonce landed): only that request is refused
        # and the others waiting are checked again; a wrong answer, or none, or a write that
        # never completed, refuses the connection's requests naming those endpoints a while
        inconclusive = answer == b""
        ok = self.owners.answered(check, answer or None, now,
                                  remember_failure=(written or timed_out) and not inconclusive)
        await self._unpark(check.conn, req if not ok else None)

    async def _unpark(self, conn: Conn, failed: PrefillRequest | None) -> None:
        """Run the requests that waited on ``conn``'s check again (``failed``: the one whose
        descriptors failed it, refused)."""
        for peer, req in self.parked.pop(conn, []):
            if req is failed:
                await self.reply(peer, PrefillFailed(
                    req.request_id, "bad_request",
                    "descriptor not owned by the requester (it failed the ownership check)"))
            else:
                await self.accept(peer, req, conn)

