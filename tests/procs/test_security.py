"""Listening sockets bind to loopback unless told otherwise: the CLI
defaults, and every TCP listener a running prefill node, decode node (with its HTTP gateway)
and their executor processes hold, read from /proc."""

from __future__ import annotations

import ipaddress

import pytest

from disagg.cli.node import build_parser
from disagg.config import NodeConfig
from nodes import node, running
from tinymodels import free_port, listening_tcp, make_tiny_model


def test_defaults_are_loopback():
    args = build_parser().parse_args([])
    assert args.listen.startswith("tcp://127.0.0.1:")
    assert args.http_listen is None  # no HTTP unless asked for
    assert NodeConfig().listen.startswith("tcp://127.0.0.1:")


@pytest.mark.fabric
def test_every_listener_of_a_running_pair_is_loopback(tmp_path):
    model_dir = make_tiny_model("llama", tmp_path / "llama")
    http_port = free_port()
    p_addr, p = node("prefill", model_dir, tmp_path, "--num-pages", "32")
    d_addr, d = node("decode", model_dir, tmp_path, "--num-pages", "32", "--prefill-peer", p_addr,
                     "--heartbeat", "0.2", "--http-listen", f"127.0.0.1:{http_port}")
    with running([p, d], [d_addr]):
        for proc, must in ((p, {p_addr}), (d, {d_addr, f"tcp://127.0.0.1:{http_port}"})):
            found = []
            for pid in [proc.proc.pid, *proc.children()]:
                found += listening_tcp(pid)
            assert {f"tcp://{a}:{port}" for a, port in found} >= must, found
            for addr, port in found:
                assert ipaddress.ip_address(addr).is_loopback, \
                    f"pid tree of {proc.log_path.name} listens on {addr}:{port}"
