"""The HTTP gateway's bounds as pure functions: the connection cap derived from the fd limit,
which connection makes room at the cap, the body budget, the flags' validation."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from disagg.serving.http_limits import (
    MIN_CONNECTIONS,
    BodyBudget,
    HttpLimits,
    connection_cap,
    fd_reserve,
    pick_victim,
)


def test_the_cap_leaves_half_the_fd_table_to_the_rest_of_the_process():
    assert fd_reserve(1 << 20) == 1 << 19 and fd_reserve(1024) == 512 and fd_reserve(300) == 256
    assert connection_cap(1024, 1 << 20, 200) == 1024  # a large table: the flag
    assert connection_cap(1024, 1024, 46) == 1024 - 46 - 512  # ulimit -n 1024: lowered
    assert connection_cap(1024, 2048, 46) == 978
    for soft in (64, 256, 1024, 4096, 65536):
        for used in (10, 100, 400):
            cap = connection_cap(1024, soft, used)
            assert cap >= MIN_CONNECTIONS
            assert cap == MIN_CONNECTIONS or soft - used - cap >= fd_reserve(soft)


def test_at_the_cap_the_oldest_idle_connection_makes_room_else_the_new_one_is_refused():
    assert pick_victim([], 4) == (True, None)
    assert pick_victim([False, True, False], 4) == (True, None)  # under the cap
    assert pick_victim([False, True, False, True], 4) == (True, 1)  # the oldest idle
    assert pick_victim([True] * 5, 4) == (True, 0)
    assert pick_victim([False] * 4, 4) == (False, None)  # every one busy: refuse


def test_the_body_budget_is_shared_and_comes_back():
    b = BodyBudget(100)
    assert b.take(60) and not b.take(41) and b.take(40)
    assert not b.take(1) and not b.take(-1)
    b.give(60)
    assert b.used == 40 and b.take(60)
    b.give(100)
    assert b.used == 0
    with pytest.raises(AssertionError):
        b.give(1)


@pytest.mark.parametrize("kw, needle", [
    (dict(max_connections=0), "--http-max-connections"),
    (dict(header_timeout_s=0), "--http-header-timeout"),
    (dict(body_timeout_s=float("nan")), "--http-body-timeout"),
    (dict(write_timeout_s=float("inf")), "--http-write-timeout"),
    (dict(body_buffer_bytes=1 << 20), "--http-body-buffer-mb"),
])
def test_out_of_range_flags_are_refused_by_name(kw, needle):
    with pytest.raises(ValueError, match=needle):
        HttpLimits(**kw).validate()
    assert HttpLimits().validate() == HttpLimits()


def test_the_soft_fd_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 512:
        pytest.skip("a hard fd limit under 512")
    code = ("import resource; from disagg.serving.http_limits import raise_nofile_limit as r; "
            "print(r(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (256, hard)), timeout=60).stdout
    assert out.split() == [f"({hard},", f"{hard})", f"({hard},", f"{hard})"], out


def test_the_flags_make_the_limits():
    from disagg.cli.node import build_parser, http_limits_from_args

    args = build_parser().parse_args([
        "--http-max-connections", "50", "--http-header-timeout", "2.5", "--http-body-timeout",
        "7", "--http-write-timeout", "3", "--http-body-buffer-mb", "64"])
    assert http_limits_from_args(args) == HttpLimits(50, 2.5, 7.0, 3.0, 8 << 20, 64 << 20)
    assert http_limits_from_args(build_parser().parse_args([])) == HttpLimits()
    with pytest.raises(ValueError, match="--http-body-timeout"):
        http_limits_from_args(build_parser().parse_args(["--http-body-timeout", "-1"]))
