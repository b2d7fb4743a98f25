"""CURVE with role-split keys: nodes hold the server keypair, clients only the server's public key
and their own keypair. Peers without authorised keys can submit neither requests nor
prefills, a client key cannot reach a prefiller's peer socket, and a client-key holder cannot
pass for a node in either direction."""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.auth

from disagg.client import Client, HandshakeError
from disagg.protocol import SamplingParams
from disagg.serving import security
from disagg.serving.security import CurveKeys, KeyFileError, load_client, load_node
from nodes import node, running, wait_for
from tinymodels import hf_greedy, make_tiny_model


def keygen_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disagg", "keygen", *args], capture_output=True,
                          text=True)


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    keys = tmp_path_factory.mktemp("curve") / "keys"
    out = keygen_cli(str(keys))
    assert out.returncode == 0, out.stderr
    assert "wrote CURVE keys" in out.stdout
    return keys


@pytest.fixture(scope="module")
def secured(keydir, tmp_path_factory):
    """A prefiller and a decoder on the node keys; the decoder also has a dead prefiller's
    address as a peer, for impostors to bind."""
    tmp = tmp_path_factory.mktemp("curve_nodes")
    model = make_tiny_model("llama", tmp / "llama")
    curve = ["--num-pages", "64", "--curve-keys", str(keydir / "node")]
    dead = f"tcp://127.0.0.1:{port_below_the_ephemeral_range()}"
    p_addr, p = node("prefill", model, tmp, *curve)
    d_addr, d = node("decode", model, tmp, "--prefill-peer", p_addr, "--prefill-peer", dead,
                     "--heartbeat", "0.2", *curve)
    with running([p, d]):  # Stats need the keys: the tests wait for the prefiller themselves
        yield keydir, p_addr, d_addr, dead, model


def port_below_the_ephemeral_range() -> int:
    """A free port no outgoing connection takes as its source port: a decoder reconnecting to
    a dead address in the ephemeral range can end up connected to itself, or another process
    can take the port, before an impostor binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def answers(addr: str, keys: CurveKeys, timeout: float = 1.5) -> bool:
    c = Client(addr, keys)
    try:
        c.stats(timeout=timeout)
        return True
    except (TimeoutError, HandshakeError):
        return False
    finally:
        c.close()


@contextmanager
def listener(addr: str, secret: bytes | None, public: bytes | None) -> Iterator[zmq.Socket]:
    """A ROUTER bound to ``addr``, a CURVE server with this keypair (plain without one), in a
    context of its own: terminating it closes the port before the next one binds it."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        sock.bind(addr)
        yield sock
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------------- key files


def test_keygen_splits_keys_by_role_in_private_files(keydir):
    node_dir, client_dir = keydir / "node", keydir / "client"
    names = {p.relative_to(node_dir).as_posix() for p in node_dir.rglob("*")}
    assert names == {"server.key", "server.key_secret", "node.key", "node.key_secret", "clients",
                     "clients/client.key", "nodes", "nodes/node.key"}
    assert {p.name for p in client_dir.iterdir()} == {"server.key", "client.key",
                                                      "client.key_secret"}
    nodes, client = load_node(node_dir), load_client(client_dir)
    assert nodes.server_secret is not None
    for path in client_dir.iterdir():  # a client can act as no node: no server or node secret
        text = path.read_bytes()
        assert nodes.server_secret not in text and nodes.secret not in text, path
    assert client.server_public == nodes.server_public and client.server_secret is None
    assert zmq.auth.load_certificate(str(node_dir / "clients" / "client.key"))[0] == client.public
    for path in [keydir, *keydir.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {mode:04o}"
    assert "DIR/node/" in (keydir / "README.txt").read_text()
    assert keygen_cli(str(keydir)).returncode == 1  # never overwrites a key set


def test_keys_are_loaded_with_errors_that_name_the_file(tmp_path):
    d = security.keygen(tmp_path / "keys")
    with pytest.raises(KeyFileError, match=r"client/server\.key_secret not found; .* a client's"):
        load_node(d / "client")
    with pytest.raises(KeyFileError, match="did you mean .*keys/client"):
        load_client(d)
    assert load_client(d / "node").public == load_node(d / "node").public  # in-node clients
    secret = d / "client" / "client.key_secret"
    secret.chmod(0o644)
    with pytest.raises(KeyFileError, match="accessible by other users .*chmod 600"):
        load_client(d / "client")
    (d / "node" / "clients").chmod(0o777)
    with pytest.raises(KeyFileError, match="clients is writable by other users"):
        load_node(d / "node")
    old = tmp_path / "old"  # the single-directory layout that gave clients the server secret
    old.mkdir()
    (old / "authorized").mkdir()
    zmq.auth.create_certificates(str(old), "server")
    with pytest.raises(KeyFileError, match="old single-directory layout"):
        load_node(old)


def test_authorised_keys_are_re_read_when_a_key_file_is_added_or_removed(tmp_path):
    clients, nodes = tmp_path / "clients", tmp_path / "nodes"
    clients.mkdir()
    nodes.mkdir()
    public, _ = zmq.auth.create_certificates(str(tmp_path), "c")
    key = zmq.auth.load_certificate(public)[0]
    authorized = security.AuthorizedKeys(clients, nodes)
    assert not authorized.callback("client", key)
    Path(public).rename(clients / "c.key")
    assert authorized.callback("client", key)
    assert not security.AuthorizedKeys(nodes).callback("node", key)  # node keys only
    (clients / "c.key").unlink()
    assert not authorized.callback("client", key)


def test_a_node_refuses_client_keys_at_startup(keydir):
    out = subprocess.run([sys.executable, "-m", "disagg", "--role", "prefill", "--curve-keys",
                          str(keydir / "client")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "server.key_secret not found" in out.stderr


def test_client_keys_cannot_serve():
    ctx = zmq.Context()
    try:
        keys = CurveKeys(Path("c"), b"S" * 40, b"P" * 40, b"s" * 40)
        security.install(ctx, keys)
        sock = ctx.socket(zmq.ROUTER)
        with pytest.raises(KeyFileError, match="cannot serve"):
            security.server(sock)
        sock.close()
    finally:
        security.uninstall(ctx)
        ctx.term()


# ---------------------------------------------------------------------------- running nodes


@pytest.mark.fabric
def test_client_with_client_keys_is_served_over_curve(secured):
    keydir, p_addr, d_addr, _, model = secured
    c = Client(d_addr, load_client(keydir / "client"))
    try:
        wait_for(lambda: c.stats(timeout=5).prefill_peers_alive == 1, what="prefiller seen")
        ids = [t for m in c.generate(prompt_token_ids=list(range(5, 14)),
                                     sampling=SamplingParams(max_tokens=4, ignore_eos=True))
               for t in getattr(m, "token_ids", [])]
        assert ids == hf_greedy(model, list(range(5, 14)), 4)
        assert c.stats().kv_units_received > 0  # the KV came over the fabric from the prefiller
    finally:
        c.close()


@pytest.mark.fabric
@pytest.mark.parametrize("target", ["decode", "prefill"])
def test_peer_without_keys_gets_nothing_in(secured, target):
    keydir, p_addr, d_addr, _, _ = secured
    addr = d_addr if target == "decode" else p_addr
    keys = load_node(keydir / "node")
    before = Client(addr, keys).stats().started
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    msg = ({"type": "generate", "request_id": "x", "prompt_token_ids": [5, 6, 7]}
           if target == "decode" else {"type": "stats"})
    sock.send(msgspec.msgpack.encode(msg))
    assert sock.poll(1500) == 0  # no handshake, no reply
    sock.close()
    ctx.term()
    c = Client(addr, keys)
    try:
        assert c.stats().started == before  # nothing was admitted
    finally:
        c.close()


@pytest.mark.fabric
def test_a_client_key_cannot_reach_the_prefillers_peer_socket(secured):
    keydir, p_addr, d_addr, _, _ = secured
    client = load_client(keydir / "client")
    assert answers(d_addr, client)  # authorised on the client-protocol socket...
    assert not answers(p_addr, client)  # ...but the peer socket admits node keys only
    assert answers(p_addr, load_node(keydir / "node"))


@pytest.mark.fabric
def test_a_client_key_holder_cannot_pass_for_a_prefiller(secured):
    """Bound on a dead prefiller's address with everything a client holds, an impostor gets
    no frame from the decoder (whose DEALER pins the server key); with the server secret, the
    same listener would."""
    keydir, _, _, dead, _ = secured
    client, nodes = load_client(keydir / "client"), load_node(keydir / "node")
    with listener(dead, client.secret, client.public) as impostor:
        assert impostor.poll(3000) == 0  # 15 heartbeats: not one reached it
    with listener(dead, nodes.server_secret, nodes.server_public) as real:
        assert real.poll(30000) != 0  # the decoder does talk to whoever holds the server key
    # without CURVE at all: last, since after a mechanism mismatch libzmq may stop
    # reconnecting to the address
    with listener(dead, None, None) as plain:
        assert plain.poll(3000) == 0


def test_a_client_key_holder_cannot_pass_for_a_node_to_clients(keydir):
    """The other side of the same pin: a client's DEALER completes no handshake with a server
    that lacks the server secret (it gets no frame), and does with one that has it."""
    client, nodes = load_client(keydir / "client"), load_node(keydir / "node")
    for secret, public, reached in ((client.secret, client.public, False),
                                    (nodes.server_secret, nodes.server_public, True)):
        with listener("tcp://127.0.0.1:*", secret, public) as server:
            c = Client(server.getsockopt_string(zmq.LAST_ENDPOINT), client)
            try:
                c.sock.send(msgspec.msgpack.encode({"type": "stats"}))
                assert (server.poll(30000 if reached else 1500) != 0) == reached
            finally:
                c.close()


@pytest.mark.fabric
def test_an_unauthorised_client_keypair_is_refused_until_added_and_after_revoked(secured, tmp_path):
    keydir, _, d_addr, _, _ = secured
    rogue = tmp_path / "rogue"  # the server's public key and a keypair of its own
    rogue.mkdir(mode=0o700)
    (rogue / "server.key").write_bytes((keydir / "client" / "server.key").read_bytes())
    _, secret_file = zmq.auth.create_certificates(str(rogue), "client")
    os.chmod(secret_file, 0o600)
    assert not answers(d_addr, load_client(rogue))
    assert not answers(d_addr, load_client(security.keygen(tmp_path / "other") / "client"))

    out = keygen_cli(str(keydir), "--add-client", "bob")
    assert out.returncode == 0, out.stderr
    bob = load_client(keydir / "client-bob")
    assert answers(d_addr, bob, timeout=10)  # the running node re-read node/clients/
    (keydir / "node" / "clients" / "client-bob.key").unlink()
    assert not answers(d_addr, bob)  # revoked for new connections
