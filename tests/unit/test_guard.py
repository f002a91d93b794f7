"""The guard's pure parts: the connection cap under a descriptor limit, aiohttp's limits from the flags,
and the knobs' defaults and validation."""

from __future__ import annotations

import resource

import pytest
from coalesce.service.gateway.guard import FD_RESERVE, connection_cap, handler_kwargs, raise_fd_limit
from coalesce.service.settings import build


def test_the_cap_is_kept_when_descriptors_allow_it() -> None:
    assert connection_cap(10_000, 1_048_576) == 10_000
    assert connection_cap(10_000, 10_000 + FD_RESERVE) == 10_000


def test_the_cap_is_lowered_to_leave_a_reserve_under_the_descriptor_limit() -> None:
    assert connection_cap(10_000, 4096) == 4096 - FD_RESERVE
    assert connection_cap(10_000, 1024) == 768  # a quarter kept when the limit is small
    assert connection_cap(10_000, 8) == 6


def test_raising_the_descriptor_limit_never_lowers_it() -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert raise_fd_limit() >= before
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= before


def test_defaults_and_aiohttps_own_limits_follow_the_flags() -> None:
    s = build([], environ={})
    assert (s.max_connections, s.keepalive_timeout_s, s.header_timeout_s, s.body_timeout_s) == (
        10_000, 75.0, 10.0, 30.0
    )
    kw = handler_kwargs(build(["--max-header-bytes", "16384", "--max-headers", "64",
                               "--keepalive-timeout-s", "5"], environ={}))
    assert kw["max_line_size"] == kw["max_field_size"] == 16384
    assert kw["max_headers"] == 64
    assert kw["keepalive_timeout"] == 5.0
    assert kw["access_log"] is None
    assert build([], environ={"COALESCE_HEADER_TIMEOUT_S": "3"}).header_timeout_s == 3.0


@pytest.mark.parametrize(
    "argv",
    [["--max-connections", "0"], ["--header-timeout-s", "0"], ["--body-timeout-s", "-1"],
     ["--keepalive-timeout-s", "0"], ["--max-headers", "0"]],
)
def test_invalid_limits_stop_start_up(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build(argv, environ={})
