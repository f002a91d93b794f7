"""The listener accepts every waiting connection when its socket is ready (service/gateway/listener.py):
uvloop's own accepts one an event-loop turn, so a flood of new connections waited in the kernel's queue
for seconds behind a busy loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import uvloop
from coalesce.service.gateway import listener
from coalesce.service.gateway.listener import Listener, bind

T = TypeVar("T")
FLOOD = 300  # connections waiting at once (within bind's backlog below)
TURNS = 10  # event-loop turns the listener gets to accept them


class _Counted(asyncio.Protocol):
    made: list[asyncio.Transport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)  # type: ignore[arg-type]


def _counting() -> tuple[list[asyncio.Transport], Callable[[], asyncio.Protocol]]:
    made: list[asyncio.Transport] = []

    def factory() -> asyncio.Protocol:
        protocol = _Counted()
        protocol.made = made
        return protocol

    return made, factory


@contextlib.contextmanager
def _clients(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections to ``port``, each open on the client's side once the kernel has queued it for
    accepting (on loopback, before the server's loop does anything)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield socks
    finally:
        for s in socks:
            s.close()


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _on_uvloop(test: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``test()`` (a coroutine function) run on uvloop, the event loop ``serve`` runs on: its result."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(test())


def _accepted_in_turns() -> int:
    """Of :data:`FLOOD` connections waiting before the loop runs, how many a :class:`Listener` has
    made within :data:`TURNS` event-loop turns."""

    async def flood() -> int:
        made, factory = _counting()
        server = Listener(bind("127.0.0.1", 0, backlog=1024), factory)
        with _clients(server.sockets[0].getsockname()[1], FLOOD):
            await _turns(TURNS)
            accepted = len(made)
            for t in made:
                t.close()
        server.close()
        return accepted

    return _on_uvloop(flood)


def test_a_flood_of_waiting_connections_is_accepted_within_a_few_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _accepted_in_turns() == FLOOD
    # The control: a listener of one accept a turn (uvloop's, libuv's since 1.45) takes at most one a turn.
    monkeypatch.setattr(listener, "ACCEPT_BURST", 1)
    assert _accepted_in_turns() <= TURNS


def test_connections_are_answered_over_the_listeners_transport() -> None:
    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data.upper())  # type: ignore[attr-defined]

    async def run() -> bytes:
        server = Listener(bind("127.0.0.1", 0, backlog=16), Echo)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        answer = await asyncio.wait_for(reader.readexactly(5), 5)
        writer.close()
        server.close()
        return answer

    assert _on_uvloop(run) == b"HELLO"


class _OutOfDescriptors(socket.socket):
    """A listening socket whose next ``fail`` accepts fail as a process out of descriptors does."""

    fail = 0

    def accept(self) -> tuple[socket.socket, object]:
        if self.fail:
            self.fail -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


def test_out_of_descriptors_the_socket_rests_then_accepts_what_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(listener, "RETRY_S", 0.05)
    sock = _OutOfDescriptors(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    sock.fail = 1
    made, factory = _counting()

    async def run() -> tuple[int, int]:
        server = Listener([sock], factory)
        with _clients(sock.getsockname()[1], 3):
            await _turns(TURNS)
            while_resting = len(made)  # the first accept failed: nothing taken for RETRY_S
            await asyncio.sleep(0.2)
            await _turns(TURNS)
            after = len(made)
            for t in made:
                t.close()
        server.close()
        return while_resting, after

    assert _on_uvloop(run) == (0, 3)


def test_a_closed_listener_takes_no_more_connections() -> None:
    made, factory = _counting()

    async def run() -> int:
        server = Listener(bind("127.0.0.1", 0, backlog=16), factory)
        port: int = server.sockets[0].getsockname()[1]
        server.close()
        server.close()  # (twice is once)
        await server.wait_closed()
        assert all(s.fileno() == -1 for s in server.sockets)
        return port

    port = _on_uvloop(run)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert made == []


def test_bind_shares_a_port_only_when_asked() -> None:
    first = bind("127.0.0.1", 0, backlog=16, reuse_port=True)
    try:
        port = first[0].getsockname()[1]
        assert first[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert not first[0].getblocking()
        second = bind("127.0.0.1", port, backlog=16, reuse_port=True)  # a --workers gateway beside it
        for s in second:
            s.close()
        with pytest.raises(OSError, match="while attempting to bind on address"):
            bind("127.0.0.1", port, backlog=16)
    finally:
        for s in first:
            s.close()
