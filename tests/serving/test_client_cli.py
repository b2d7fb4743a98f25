"""``disagg-client`` fails fast, in one line, with a documented exit code: nothing answering its
first ``ping`` within ``--connect-timeout`` exits 4, a node that answers it but not the request
exits 3 at ``--timeout``, and a bad ``--prompt-token-ids`` or ``--connect`` is a usage error
(2). Against no node, a silent socket, or a fake node on ZeroMQ that answers pings only."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from disagg.cli.client import main
from disagg.protocol import Ping
from nodes import FakeClientNode
from tinymodels import free_port


@pytest.fixture
def ping_only() -> Iterator[FakeClientNode]:
    n = FakeClientNode(generate=False)  # answers pings only
    try:
        yield n
    finally:
        n.close()


def exit_of(argv: list[str]) -> tuple[int, float]:
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, int)
    return e.value.code, time.monotonic() - start


def test_no_node_at_the_address_exits_4_at_the_connect_deadline(capsys):
    addr = f"tcp://127.0.0.1:{free_port()}"
    code, took = exit_of(["--connect", addr, "--prompt", "hi", "--connect-timeout", "0.5"])
    assert code == 4
    assert took < 60  # at its own bound, not the request's 600 s
    assert capsys.readouterr().err == f"disagg-client: no node answers at {addr} within 0.5 s\n"


def test_a_silent_socket_exits_4_and_wait_is_the_connect_deadline(capsys):
    silent = FakeClientNode(pings=False, generate=False)
    try:
        code, took = exit_of(["--connect", silent.address, "--stats", "--wait", "0.5"])
    finally:
        silent.close()
    assert code == 4
    assert took < 60  # at its own bound, not the request's 600 s
    assert [type(m) for m in silent.got][:1] == [Ping]  # it pinged; nothing else was sent
    assert not [m for m in silent.got if not isinstance(m, Ping)]
    err = capsys.readouterr().err
    assert err == f"disagg-client: no node answers at {silent.address} within 0.5 s\n"


def test_a_node_that_answers_the_ping_is_bounded_by_timeout(ping_only, capsys):
    code, took = exit_of(["--connect", ping_only.address, "--prompt-token-ids", "1,2",
                          "--timeout", "0.5", "--connect-timeout", "2"])
    assert code == 3
    assert took < 60  # at its own bound, not the request's 600 s
    assert "no reply from the node in 0.5s" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--prompt-token-ids", "a,b"], "--prompt-token-ids"),
    (["--prompt-token-ids", "1,2", "--logit-bias", "1"], "--logit-bias"),
    (["--prompt", "hi", "--connect", "127.0.0.1:7901"], "--connect"),
    (["--prompt", "hi", "--connect", "tcp://127.0.0.1"], "--connect"),  # no port
    (["--stats", "--connect", "tcp://127.0.0.1:notaport"], "--connect"),
])
def test_bad_flag_values_are_one_line_usage_errors(argv, flag, capsys):
    code, took = exit_of(argv)
    assert code == 2
    assert took < 60  # refused at once (exit 2, not a connect deadline's 4)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"disagg-client: {flag}"), err
