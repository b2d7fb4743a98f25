"""The prefiller's ownership gate: a PrefillRequest is served only once the connection that sent
it proved it owns the endpoints it names (``disagg.remote.ownership``): a random nonce is
written into the challenge area it advertised, through every lane, and must come back over the
same connection. Requests wait here meanwhile (no job slot, no page); one check per connection
at a time, each within the ownership timeout, at most ``MAX_CHECKS`` under way in all and fewer
per peer identity and per address (``disagg.remote.check_quotas``); a failed check backs its
identity off. A request whose check cannot start yet waits for one to end (in arrival order,
before any new offer; refused ``overloaded`` past ``WAIT_FACTOR`` ownership timeouts). A nonce
source slot comes back once its write is known dead (completed, failed, or never posted); only
a write posted and unfinished at its deadline keeps it out for the quarantine.

A decoder offers its endpoints ahead of its requests (``OwnershipOffer``, when it first finds
this prefiller compatible on a connection): the same check then runs with no request waiting
on it, so its first request finds the binding made. Once it passed, the KV descriptors offered
(those on the endpoints just proven) are mapped ahead of their first write (cuda-ipc)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import torch

from disagg.fabric.expectations import NotPosted, TransferTimeout
from disagg.protocol.peer import Challenge, OwnershipOffer, PrefillFailed, PrefillRequest
from disagg.remote.admission import NOT_OWNED
from disagg.remote.check_quotas import CheckQuotas, CheckWaits, Outcome
from disagg.remote.ownership import (
    CHALLENGE_AREA_BYTES,
    CHALLENGE_SLOTS,
    NONCE_BYTES,
    SLOT_BYTES,
    Check,
    Conn,
    NonceSlots,
    OwnershipBook,
    endpoints,
    lane_weights,
    nonce_offset,
)
from disagg.remote.transfer_plan import Runs, Write
from disagg.transfer import TransferEngine

log = logging.getLogger(__name__)

NONCE_SOURCE_SLOTS = 4096  # nonces being written (a write posted, never done, rests 10 min)
MAX_CHECKS = 64  # ownership checks under way at once, all connections
CHECKS_PER_IDENTITY = 8  # ... of one peer identity (its connection; with CURVE key@address)
CHECKS_PER_ADDRESS = 16  # ... from one peer address
WAIT_FACTOR = 3.0  # a request waits this many ownership timeouts for its check to start
OFFER_RECHECK_S = 60.0  # an offer re-checks a binding verified longer ago than this

Start = tuple[bytes, Any, list[Any], int, int, "PrefillRequest | None"]  # what _start takes


def known_dead(results: list[Any]) -> bool:
    """Whether no write of a check can still read its nonce slot: every posted write
    completed or failed (the provider is done with it), or none was posted."""
    return all(r is None or not isinstance(r, TransferTimeout) or isinstance(r, NotPosted)
               for r in results)


class OwnershipGate:
    def __init__(self, transfer: TransferEngine, timeout_s: float, max_parked: int,
                 reply: Callable[[bytes, Any], Awaitable[None]],
                 accept: Callable[[bytes, PrefillRequest, Conn], Awaitable[None]],
                 spawn: Callable[[Coroutine[Any, Any, None]], None]):
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.max_parked = max_parked  # requests of one connection waiting for its check
        self.reply, self.accept, self.spawn = reply, accept, spawn
        # nonces are written from their own source buffer (never a context row), on endpoints
        # of their own: a nonce the receiver refuses (a requester named a revoked window) drops
        # the connection it came on, and no KV write is on that one (TransferEngine.probes)
        self.probes = transfer.probes()
        self.nonce_buf = self.probes.context_buffer(NONCE_SOURCE_SLOTS, SLOT_BYTES)
        self.nonce_region = self.probes.register(self.nonce_buf.view(-1), access="source")
        self.nonce_slots = NonceSlots(NONCE_SOURCE_SLOTS)
        self.owners = OwnershipBook()
        self.quotas = CheckQuotas(MAX_CHECKS, CHECKS_PER_IDENTITY, CHECKS_PER_ADDRESS)
        self.who: dict[Conn, tuple[bytes, str]] = {}  # conn -> (peer identity, address)
        self.waits: CheckWaits[Conn, Start] = CheckWaits()  # checks not started yet
        self.parked: dict[Conn, list[tuple[bytes, PrefillRequest]]] = {}  # waiting for a check
        self.answers: dict[tuple[Conn, int], asyncio.Future[bytes]] = {}

    def seen(self, conn: Conn, identity: bytes | None, address: str | None) -> None:
        """A new connection: its peer's identity (with CURVE its key; None: the connection
        is the identity) and address, which its checks count against."""
        address = address or ""
        self.who[conn] = ((identity + b"@" + address.encode()) if identity else conn[0], address)
        if len(self.who) > 1 << 16:  # fds never reported (None): the oldest go
            self.who.pop(next(iter(self.who)))

    def _who(self, conn: Conn) -> tuple[bytes, str]:
        return self.who.get(conn, (conn[0], ""))

    def status(self, conn: Conn, endpoints: frozenset[bytes], now: float) -> str:
        """``owned``, ``refused`` (failed a check a while ago) or ``unknown`` (check first)."""
        return self.owners.status(conn, endpoints, now)

    def answered(self, conn: Conn, check_id: int, nonce: bytes) -> None:
        """A ChallengeAnswer arrived on ``conn``."""
        fut = self.answers.get((conn, check_id))
        if fut is not None and not fut.done():
            fut.set_result(nonce)

    def withdraw(self, conn: Conn, request_id: str) -> None:
        """Drop a parked request (aborted): it was never accepted, nothing of it is written
        (a check waiting to start with its descriptors runs with the next one's, ``tick``)."""
        parked = self.parked.get(conn, [])
        for item in [p for p in parked if p[1].request_id == request_id]:
            parked.remove(item)

    def disconnected(self, fd: int) -> None:
        for conn in self.owners.forget(fd) + [c for c in self.who if c[1] == fd]:
            self.parked.pop(conn, None)  # nobody to answer
            self.waits.remove(conn)
            self.who.pop(conn, None)

    async def tick(self, now: float) -> None:
        """Refuse the requests whose check could not start within ``WAIT_FACTOR`` ownership
        timeouts, then start the waiting checks that may start now (a back-off ended)."""
        for conn, _ in self.waits.expired(now):
            for peer, req in self.parked.pop(conn, []):
                await self.reply(peer, PrefillFailed(
                    req.request_id, "overloaded", "too many ownership checks under way: this "
                    "decoder's could not start within the ownership timeout"))
        if self.waits:
            await self._start_waiting()

    def waiting(self) -> int:
        return sum(len(p) for p in self.parked.values())

    async def park(self, peer: bytes, conn: Conn, req: PrefillRequest, dst_ctx: Any,
                    lanes: list[Any]) -> None:
        """Hold a request until its connection proved it owns the endpoints named (one check
        per connection at a time; no job slot or page is taken meanwhile)."""
        parked = self.parked.get(conn, [])
        if len(parked) >= self.max_parked:
            await self.reply(peer, PrefillFailed(
                req.request_id, "overloaded",
                "too many requests of this decoder wait for its ownership check"))
            return
        self.parked.setdefault(conn, []).append((peer, req))
        if conn in self.owners.checks or conn in self.waits:
            return
        start: Start = (peer, dst_ctx, lanes, req.challenge_slot, req.challenge_key, req)
        if self.waits or not self._start(conn, *start, []):  # those waiting go first
            self.waits.add(conn, start, time.monotonic() + WAIT_FACTOR * self.timeout_s)
            await self._start_waiting()

    async def _start_waiting(self) -> None:
        """Start the waiting checks that may start now, in arrival order. One whose request
        was withdrawn meanwhile is not started: the requests left are checked afresh."""
        for conn, start in self.waits.in_order():
            if conn not in self.waits:  # started or refused meanwhile (a nested call)
                continue
            req = start[5]
            if not any(r is req for _, r in self.parked.get(conn, [])):
                self.waits.remove(conn)
                await self._unpark(conn, None)  # they park again, with their own descriptors
            elif self._start(conn, *start, []):
                self.waits.remove(conn)

    async def offered(self, peer: bytes, conn: Conn, offer: OwnershipOffer) -> None:
        """A decoder offered its endpoints ahead of its requests: check them now, unless
        verified within ``OFFER_RECHECK_S``, refused lately, or a check is under way (busy:
        none; its first request is checked then, as without the offer)."""
        try:
            dst_ctx = self.transfer.decode_descriptor(offer.dst_ctx)
            dst_kv = [self.transfer.decode_descriptor(d) for d in offer.dst_kv]
            lanes, why = endpoints(dst_kv, dst_ctx, self.transfer.lanes)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            why = f"bad memory descriptor: {e}"
        if why is None and not 0 <= offer.challenge_slot < CHALLENGE_SLOTS:
            why = f"challenge slot {offer.challenge_slot} out of range"
        if why is None and dst_ctx.length < CHALLENGE_AREA_BYTES:
            why = "context descriptor smaller than the challenge area"
        if why is not None:
            await self.reply(peer, PrefillFailed("", "bad_request", f"ownership offer: {why}"))
            return
        now = time.monotonic()
        addresses = frozenset(d.address for d in lanes)
        if (conn in self.owners.checks or conn in self.waits or self.waits
                or self.owners.status(conn, addresses, now) == "refused"
                or self.owners.status(conn, addresses, now + self.owners.ttl_s
                                      - OFFER_RECHECK_S) == "owned"):
            return  # busy, or requests wait for a check: they go first
        self._start(conn, peer, dst_ctx, lanes, offer.challenge_slot, offer.challenge_key,
                    None, dst_kv)

    def _start(self, conn: Conn, peer: bytes, dst_ctx: Any, lanes: list[Any], area_slot: int,
               key: int, req: PrefillRequest | None, prepare: list[Any]) -> bool:
        """Start a check of ``lanes`` (for ``req``, or ahead of requests: None); False when
        the quotas or the nonce slots do not allow one now."""
        now = time.monotonic()
        identity, address = self._who(conn)
        if self.quotas.refusal(identity, address, now) is not None:
            return False
        slot = self.nonce_slots.take(now)
        if slot is None:
            return False
        self.quotas.started(identity, address)
        check = self.owners.start(conn, frozenset(d.address for d in lanes), len(lanes))
        self.spawn(self._check(peer, check, slot, dst_ctx, lanes, (area_slot, key), req,
                               prepare))
        return True

    async def _check(self, peer: bytes, check: Check, slot: int, dst_ctx: Any,
                     lanes: list[Any], target: tuple[int, int], req: PrefillRequest | None,
                     prepare: list[Any]) -> None:
        """Write the nonce through every lane into challenge slot ``target[0]`` under key
        ``target[1]``, ask the connection for it back, then serve or refuse the requests that
        waited; all within the ownership timeout. Passed: ``prepare`` (descriptors on the
        endpoints proven) is mapped ahead of its first write."""
        deadline = time.monotonic() + self.timeout_s
        futures: list[asyncio.Future[None]] = []
        results: list[Any] = []  # of the posted writes: None (completed) or an exception
        answer = None
        written = False
        timed_out = False
        try:
            nonce = torch.frombuffer(bytearray(check.nonce), dtype=torch.uint8)
            self.nonce_buf[slot, :len(check.nonce)] = nonce.to(self.nonce_buf.device)
            try:
                for i, (lane, units) in enumerate(zip(lanes, lane_weights(len(lanes)), strict=True)):
                    w = Write(slot * SLOT_BYTES + i * NONCE_BYTES,
                              nonce_offset(dst_ctx.length, target[0], i), NONCE_BYTES, units)
                    # not KV: Stats.kv_writes_sent / kv_bytes_sent count KV only
                    futures += self.probes.write(self.nonce_region, lane, Runs.of([w]),
                                                   target[1], timeout=self.timeout_s,
                                                   counted=False)
            finally:  # every posted write settles by the timeout
                results = await asyncio.gather(*futures, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
            written = True
            fut = asyncio.get_running_loop().create_future()
            self.answers[(check.conn, check.id)] = fut
            await self.reply(peer, Challenge(check.id, len(lanes),
                                             req.request_id if req is not None else ""))
            answer = await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - any failure is a failed check
            timed_out = isinstance(e, TimeoutError)
            log.warning("ownership check %d of a decoder failed: %s", check.id,
                        e.__class__.__name__ + (f": {e}" if str(e) else ""))
        finally:
            self.answers.pop((check.conn, check.id), None)
            now = time.monotonic()
            self.nonce_slots.give(slot, written or known_dead(results), now)
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
        # any failure but an abstention costs the offerer: its identity backs off
        outcome: Outcome = "passed" if ok else "inconclusive" if inconclusive else "failed"
        self.quotas.ended(*self._who(check.conn), outcome, now)
        if ok and prepare:
            try:  # an optimisation only: the requests that waited are answered regardless
                self.transfer.prepare(prepare)
            except Exception as e:  # noqa: BLE001
                log.warning("mapping offered regions ahead failed: %s", e)
        await self._unpark(check.conn, req if not ok else None)
        if self.waits:  # a check ended: one that waits may start
            await self._start_waiting()

    async def _unpark(self, conn: Conn, failed: PrefillRequest | None) -> None:
        """Run the requests that waited on ``conn``'s check again (``failed``: the one whose
        descriptors failed it, refused)."""
        for peer, req in self.parked.pop(conn, []):
            if req is failed:
                await self.reply(peer, PrefillFailed(req.request_id, "bad_request", NOT_OWNED))
            else:
                await self.accept(peer, req, conn)

