"""A ZeroMQ socket on the event loop, read and written without a future per message.

``zmq.asyncio`` gives every ``recv`` and ``send`` its own future and re-arms a reader on each, which
profiling the engine at 1,200 small requests/s showed as the largest single share of its CPU. Here the
socket's file descriptor is watched once (``add_reader``), and each wake-up reads every message that is
ready, straight into ``on_message``; a send is one non-blocking call. Sockets here have no high-water
mark (``SNDHWM`` 0), so a send waits for nothing; one that still cannot go (no peer is connected any
more) is logged and dropped, which is what the peer's death means anyway.

ZeroMQ's descriptor is edge-triggered and says only that the socket's events may have changed: after
any send or receive the events are read again (``zmq.EVENTS``), or a message that arrived meanwhile
would wait for the next edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..logs import get_logger

log = get_logger("coalesce.engine")

# As plain ints: pyzmq's flags are enum.Flag members, whose operators run Python code on every call.
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


class Channel:
    """``sock`` on the running loop: ``on_message`` gets each multipart message (``zmq.Frame``s, or
    ``bytes`` with ``copy``) as it arrives; :meth:`send` sends one. Event loop only."""

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[Any]], None], name: str,
                 copy: bool = False) -> None:
        self._sock = sock
        self._on_message = on_message
        self._name = name
        self._copy = copy
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recheck_due = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.FD, self._read)
        self._recheck()  # messages that arrived before the reader was added raised no edge

    def _read(self) -> None:
        self._recheck_due = False
        sock = self._sock
        while not sock.closed and cast(int, sock.get(zmq.EVENTS)) & _POLLIN:
            try:
                parts = [sock.recv(_NOBLOCK, copy=self._copy)]
                while sock.getsockopt(_RCVMORE):  # the rest of a multipart message is here already
                    parts.append(sock.recv(_NOBLOCK, copy=self._copy))
            except zmq.Again:
                return
            try:
                self._on_message(parts)
            except Exception:  # one bad message must not stop the socket being read
                log.exception("channel_message_failed", channel=self._name)

    def _recheck(self) -> None:
        if not self._recheck_due and self._loop is not None:
            self._recheck_due = True
            self._loop.call_soon(self._read)

    def send(self, parts: list[Any]) -> bool:
        """Send one multipart message now; False (logged) if it could not go."""
        try:
            sock = self._sock
            for part in parts[:-1]:
                sock.send(part, _NOBLOCK_MORE, copy=False)
            sock.send(parts[-1], _NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            log.error("channel_send_failed", channel=self._name, error=repr(exc))
            return False
        finally:
            self._recheck()  # the send may have taken the descriptor's edge for an incoming message

    def close(self) -> None:
        """Stop reading and close the socket. Idempotent."""
        if self._sock.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.FD)
        self._sock.close(linger=0)


class Link:
    """One end of the engine–gateway link: a DEALER socket (no linger, no high-water marks: a send never
    waits, and nothing is kept at exit) read by one :class:`Channel`, and its monitor socket (the peer's
    connections, ``events`` a ``zmq.EVENT_*`` mask) read by another, each event's number handed to
    ``on_event``. Bind or connect :attr:`sock` before :meth:`start`. Event loop only."""

    def __init__(self, ctx: zmq.Context[Any], name: str, on_message: Callable[[list[Any]], None],
                 events: int, on_event: Callable[[int], None]) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            self.sock.setsockopt(option, value)
        monitor = self.sock.get_monitor_socket(events)
        self._messages = Channel(self.sock, on_message, name)
        self._events = Channel(
            monitor, lambda parts: on_event(parse_monitor_message(parts)["event"]), f"{name}-monitor",
            copy=True,
        )

    def start(self) -> None:
        self._messages.start()
        self._events.start()

    def send(self, parts: list[Any]) -> bool:
        """Send one multipart message now; False (logged) if it could not go."""
        return self._messages.send(parts)

    @property
    def closed(self) -> bool:
        return bool(self.sock.closed)

    def close(self) -> None:
        """Stop both readers and close both sockets. Idempotent."""
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self._events.close()
        self._messages.close()
