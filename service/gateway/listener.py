"""Listening sockets that accept every waiting connection when they are ready, not one an event-loop turn.

uvloop's listener is libuv's, which accepts one connection each time the listening socket is reported
ready (since libuv 1.45, "don't accept() connections in a loop": a second ``accept`` nearly always finds
nothing, they found). A turn of a loaded event loop reads, checks and answers every request that
arrived on every connection: tens of milliseconds under an overload (``strace`` showed one ``accept4``
a turn), while clients opened thousands a second. The kernel's queue of connections waiting to be
accepted filled (2,048 deep here) and stayed full for seconds: a client's connection there is
open to it and its request sent, unread; past the queue its handshake is dropped and retried after 1,
3, 7, 15 s. A cold server flooded at four times its capacity by fresh connections (a replica that
comes up under load, clients whose pools grow) answered 1% of the requests it admitted 9 to 14 s late,
every one of them sent in the flood's first second (BENCHMARKS.md, 2026-12-06).

Here each socket is read by the event loop (``add_reader``) and, when ready, accepts what waits, up to
:data:`ACCEPT_BURST` a turn, and hands each connection to the loop as ``loop.connect_accepted_socket``
(asyncio's API for sockets accepted outside the loop; the transport is uvloop's as before). asyncio's
own selector loop accepts so too (up to its backlog a turn). Out of descriptors (``EMFILE``: the
connection cap's reserve used up, by refusals still lingering or the process's own files), the socket
rests for :data:`RETRY_S` and the connections wait in the kernel's queue, as asyncio does, to be
answered once descriptors free up (uvloop's listener accepted and closed them: a reset).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable

from ..logs import get_logger

log = get_logger("coalesce.listener")

# Connections accepted a turn at most: a flood's queue drains in a few turns, and no turn is taken by
# accepting alone (an accept and its transport cost tens of microseconds).
ACCEPT_BURST = 512
# Out of descriptors or kernel memory: how long the socket rests before accepting again.
RETRY_S = 0.1
# accept() failures that are the connection's (it went away before it was accepted): take the next one.
_THEIRS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})


def bind(host: str | None, port: int, backlog: int, reuse_port: bool = False) -> list[socket.socket]:
    """Non-blocking listening sockets for ``host`` (every address it resolves to, as
    ``loop.create_server`` binds; all interfaces for None or "") and ``port``: ``socket.create_server``'s
    (``SO_REUSEADDR``, IPv6 sockets IPv6 only), with ``SO_REUSEPORT`` when asked (``--workers``
    gateways share the port)."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, _, _, _, address in dict.fromkeys(infos):
            sock = socket.create_server(address, family=family, backlog=backlog, reuse_port=reuse_port)
            socks.append(sock)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


class Listener:
    """Accepts ``socks``' connections on the running loop for ``factory`` (a protocol factory), each
    ready socket up to :data:`ACCEPT_BURST` a turn. Quacks as much of ``asyncio.Server`` as aiohttp's
    site uses (``close``, ``wait_closed``, ``sockets``)."""

    def __init__(self, socks: list[socket.socket], factory: Callable[[], asyncio.BaseProtocol]) -> None:
        self.sockets = tuple(socks)
        self._factory = factory
        self._loop = asyncio.get_running_loop()
        self._resting: dict[int, asyncio.TimerHandle] = {}
        self._failing = False  # accepts fail (out of descriptors): logged once until one succeeds
        self._connecting: set[asyncio.Task[None]] = set()  # (the loop keeps only weak references to tasks)
        self._closed = False
        for sock in socks:
            self._loop.add_reader(sock.fileno(), self._ready, sock)

    def _ready(self, sock: socket.socket) -> None:
        loop, factory = self._loop, self._factory
        for _ in range(ACCEPT_BURST):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # nothing more waits
            except OSError as exc:
                if exc.errno in _THEIRS:
                    continue
                self._rest(sock, exc)
                return
            self._failing = False
            conn.setblocking(False)
            task = loop.create_task(_connect(loop, factory, conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    def _rest(self, sock: socket.socket, exc: OSError) -> None:
        """Stop accepting on ``sock`` for :data:`RETRY_S` (out of descriptors or kernel memory)."""
        fd = sock.fileno()
        if not self._failing:  # (every RETRY_S while it lasts would flood the log)
            self._failing = True
            log.warning("accept_failed", error=str(exc), retry_s=RETRY_S)
        self._loop.remove_reader(fd)
        self._resting[fd] = self._loop.call_later(RETRY_S, self._resume, sock)

    def _resume(self, sock: socket.socket) -> None:
        self._resting.pop(sock.fileno(), None)
        if not self._closed:
            self._loop.add_reader(sock.fileno(), self._ready, sock)

    def close(self) -> None:
        """Stop listening: accept nothing more and close the sockets (the connections stay)."""
        if self._closed:
            return
        self._closed = True
        for sock in self.sockets:
            fd = sock.fileno()
            timer = self._resting.pop(fd, None)
            if timer is not None:
                timer.cancel()
            else:
                self._loop.remove_reader(fd)
            sock.close()

    async def wait_closed(self) -> None:
        return None


async def _connect(loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.BaseProtocol],
                   conn: socket.socket) -> None:
    try:
        await loop.connect_accepted_socket(factory, conn)
    except OSError as exc:  # the connection went away while its transport was made
        conn.close()
        log.debug("connection_lost_at_accept", error=str(exc))
