"""A stranger on the decoder's host attacks its fabric endpoint with plain libfabric while
remote prefills run (real prefill + decode processes, tcp on loopback).

What it knows: the decoder's endpoint address (it scans the decoder's listening TCP ports, as
any local process can, and tries each as a libfabric tcp address), the old predictable layout
of keys (registration keys 1, 2, ...; immediates (slot, generation 1, 2, ...) with the exact
unit count of a prompt). What it tries, again and again while victims prefill and decode:
scribbling with guessed keys, reads, forged immediates (the crash variant: one-byte writes for
plausible keys; the spoof variant: the exact weight), writes past the region. None may change
a victim's greedy tokens, crash the node, leak a byte, or leave a page behind.
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from disagg.remote.transfer_plan import make_imm, make_key
from fabric_attacker import READ, WRITE, WRITEDATA, Attacker
from nodes import PAGE, Req, node, pools_full, prompt, running, stats, tokens, wait_for
from tinymodels import listening_tcp, make_tiny_model

pytestmark = pytest.mark.fabric

LENGTHS = [9, 14, 23]  # victims' prompt lengths (remote prefills)
NEW = 5
LAYERS = 2  # the tiny model's
KEYS = list(range(0, 65)) + [0xFF, 0xFFFF, 0xFFFFFFFF, (1 << 64) - 1, 0xDEADBEEF, 1 << 32]
OFFSETS = [o * 512 for o in range(64)]  # spread over the start of a region


def endpoint_candidates(pid: int, zmq_port: int) -> list[bytes]:
    """libfabric tcp addresses (sockaddr_in) of every other port the decoder listens on."""
    out = []
    for host, port in listening_tcp(pid):
        if port != zmq_port and ":" not in host:
            out.append(struct.pack("<H", socket.AF_INET) + struct.pack(">H", port)
                       + socket.inet_aton(host) + bytes(8))
    return out


def units(n: int) -> int:
    """What the decoder waits for from one prompt of ``n`` tokens: layers x pages + context."""
    return LAYERS * -(-(n - 1) // PAGE) + 1


class Campaign:
    """Every attack against every candidate address, in a loop, until stopped."""

    def __init__(self, targets: list[bytes]) -> None:
        self.targets = targets
        self.stop = threading.Event()
        self.rounds = 0
        self.leaked = 0  # reads that completed with data
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _ops(self, target: bytes, op: int, addrs: list[int], keys: list[int],
             imms: list[int] | None = None, length: int = 64) -> list[int]:
        a = Attacker("tcp", buflen=1 << 12)  # a fresh connection: refused ops may close one
        try:
            a.buffer()[:] = b"\xA5" * (1 << 12) if op != READ else bytes(1 << 12)
            errs = a.ops(op, a.peer(target), addrs, keys, imms, length, timeout_ms=300)
            if op == READ:
                self.leaked += sum(e == 0 for e in errs) + (bytes(a.buffer()) != bytes(1 << 12))
            return errs
        finally:
            a.close()

    def _run(self) -> None:
        guesses = [(slot, gen) for slot in range(16) for gen in range(1, 17)]
        while not self.stop.is_set():
            for t in self.targets:
                # scribble: every guessed key at every offset, with and without immediates
                addrs = [o for o in OFFSETS for _ in KEYS]
                keys = KEYS * len(OFFSETS)
                self._ops(t, WRITE, addrs, keys)
                self._ops(t, WRITEDATA, addrs, keys, [make_imm(make_key(1, 1), 1)] * len(addrs))
                # crash variant: 256 one-byte writes with immediates of plausible keys
                for k in KEYS[:8]:
                    self._ops(t, WRITEDATA, [0] * len(guesses), [k] * len(guesses),
                              [make_imm(make_key(s, g), 1) for s, g in guesses], length=1)
                    # spoof variant: exactly the weight a victim's transfer waits for
                    for n in LENGTHS:
                        self._ops(t, WRITEDATA, [0] * len(guesses), [k] * len(guesses),
                                  [make_imm(make_key(s, g), units(n)) for s, g in guesses], 1)
                # reads of the KV / context regions
                self._ops(t, READ, OFFSETS[:8] * 8, [k for k in KEYS[:8] for _ in range(8)])
                # writes past any region
                self._ops(t, WRITEDATA, [1 << 40, (1 << 63) - 64, 1 << 30] * 8,
                          [k for k in KEYS[:8] for _ in range(3)],
                          [make_imm(make_key(0, 1), 1)] * 24)
            self.rounds += 1


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("attack")
    model = make_tiny_model("llama", tmp / "llama")
    fabric = ["--fabric-provider", "tcp"]
    p_addr, p = node("prefill", model, tmp, "--num-pages", "96", "--max-batch-tokens", "7",
                     *fabric)
    d_addr, d = node("decode", model, tmp, "--num-pages", "96", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", "--prefill-timeout", "20", *fabric)
    with running([p, d], [d_addr]):
        yield d_addr, d


def test_a_local_stranger_cannot_touch_kv_crash_or_read(pair):
    d_addr, d = pair
    reference = {n: tokens(d_addr, prompt(n, salt=7), NEW) for n in LENGTHS}  # unattacked
    targets = endpoint_candidates(d.proc.pid, int(d_addr.rsplit(":", 1)[1]))
    assert targets, "the decoder listens on no port but its own"
    campaign = Campaign(targets)
    campaign.thread.start()
    try:
        wait_for(lambda: campaign.rounds >= 1, timeout=120, what="one round of attacks")
        for _ in range(3):  # victims prefill and decode while the attacks go on
            victims = [Req(d_addr, prompt(n, salt=7), max_tokens=NEW) for n in LENGTHS * 2]
            for v in victims:
                v.join()
                assert v.code is None, f"victim failed: {v.code}"
                assert v.tokens == reference[len(v.ids)], "a victim's output changed"
    finally:
        campaign.stop.set()
        campaign.thread.join(120)
    assert d.proc.poll() is None, "the decode node died"
    assert campaign.leaked == 0, "a read of the decoder's memory succeeded"
    s = stats(d_addr)
    assert s.kv_junk_immediates == 0  # with unguessable keys not one forged write landed
    wait_for(lambda: pools_full(d_addr), what="pages back")
    # and it still serves remote prefills, token-exact
    assert tokens(d_addr, prompt(LENGTHS[-1], salt=7), NEW) == reference[LENGTHS[-1]]
