"""A decoder's answers to ownership checks (``prefill_peers.Challenges``) read each check's own
nonce: also after it abstained from one (a request it had aborted), whose nonce stays in the
slot and must not be taken for the next check's."""

from __future__ import annotations

import asyncio
import secrets

import msgspec
import torch

from disagg.actors.decode_messenger.prefill_peers import Challenges, Peer
from disagg.protocol.peer import Challenge, ChallengeAnswer, PeerReply
from disagg.remote.ownership import CHALLENGE_AREA_BYTES, NONCE_BYTES, nonce_offset


class Sock:
    def __init__(self) -> None:
        self.sent: list[ChallengeAnswer] = []

    async def send(self, frame: bytes, flags: int = 0) -> None:
        msg = msgspec.msgpack.decode(frame, type=PeerReply | ChallengeAnswer)
        assert isinstance(msg, ChallengeAnswer)
        self.sent.append(msg)


class Done:
    """A challenge key whose expectation an earlier check completed."""

    def __init__(self) -> None:
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.future.set_result(None)


def land(buf: torch.Tensor, peer: Peer) -> bytes:
    """A prefiller's nonce write into ``peer``'s slot (one lane)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    at = nonce_offset(buf.numel(), peer.slot, 0)
    buf[at:at + NONCE_BYTES] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
    return nonce


async def test_after_an_abstention_the_next_check_is_answered_with_its_own_nonce():
    buf = torch.zeros(4096 + CHALLENGE_AREA_BYTES, dtype=torch.uint8)
    sock = Sock()
    peer = Peer("tcp://prefiller", sock, slot=3)  # type: ignore[arg-type]
    peer.challenge = (7, Done())
    answers = Challenges(None, [], None, buf)

    offer = land(buf, peer)
    await answers.answer(peer, Challenge(1, 1, ""), abstain=False)
    aborted = land(buf, peer)  # a check of a request the decoder no longer wants
    await answers.answer(peer, Challenge(2, 1, "gone"), abstain=True)

    async def late_write() -> bytes:
        await asyncio.sleep(0.05)  # the next check's nonce lands after its Challenge
        return land(buf, peer)

    writer = asyncio.create_task(late_write())
    await answers.answer(peer, Challenge(3, 1, "next"), abstain=False)
    assert [a.nonce for a in sock.sent] == [offer, b"", await writer]
    assert aborted != sock.sent[2].nonce
