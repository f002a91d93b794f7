"""The engine–gateway link: one Unix stream socket per gateway, read and written by the event loop.

A message is a list of frames (``engine/messages.py``: frame 0 a msgspec message, the others raw
arrays). On the socket it is its frame count and each frame's length, little-endian unsigned 32-bit
integers, then the frames back to back. A send is one ``writelines`` on the loop's transport (one
``writev`` when the socket takes it); a receive hands ``on_message`` views of the bytes the loop read,
with no copy when a message arrived whole in one read (a message split across reads is joined once).

Why not ZeroMQ, which this link used before: every ZeroMQ message goes through an I/O thread of its own
on each side, so each one wakes two threads besides the event loops. On a 2-core virtual machine that
about doubled the CPU a small message's round trip between two processes costs each side
(``python -m coalesce.loadtests.engine_ops`` measures both), and messages were a large share of what
the engine and the gateways spent per request once the model cost nothing. The socket also tells a
peer's death itself:
``connection_lost`` fires at once when the other process goes, however it went (no polling, no
timeout), which is what a monitor socket reported before.

The engine's end listens (:meth:`Link.listen`) and takes one peer at a time (its gateway); the gateway's
end connects (:meth:`Link.connect`), retrying until the engine has bound its socket, and keeps what it
sends before that in order until the connection is up. ``on_up`` and ``on_down`` say when a peer
connects and when it goes. Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable, Sequence

from ..logs import get_logger

log = get_logger("coalesce.engine")

Buffer = bytes | bytearray | memoryview

# A message of more frames, or more bytes, than this breaks the protocol (no message comes near): the
# connection is closed as a peer that went away, rather than waiting for data that never comes.
MAX_FRAMES = 64
MAX_MESSAGE_BYTES = 1 << 31
_COUNT = struct.Struct("<I")
_HEADS: dict[int, struct.Struct] = {}  # a message's head (frame count, lengths) by its frame count
# How often a gateway tries again while the engine's socket is not there yet (it starts alongside).
_RETRY_S = (0.01, 0.2)  # first, longest


class _Protocol(asyncio.Protocol):
    """Frames messages out of the stream for one connection."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self._rest = bytearray()  # the start of a message that has not all arrived
        self._need = 0  # bytes ``_rest`` must hold before parsing again is worth it
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._link._connected(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._link._disconnected(self)

    def data_received(self, data: bytes) -> None:
        if self._rest:
            self._rest += data
            if len(self._rest) < self._need:
                return  # (a large message arriving in pieces is joined once, when it is all here)
            data = bytes(self._rest)
            self._rest.clear()
        view, end, at = memoryview(data), len(data), 0
        need = 4
        while end - at >= 4:
            (count,) = _COUNT.unpack_from(data, at)
            head = 4 + 4 * count
            if count < 1 or count > MAX_FRAMES:
                self._broken(f"a message of {count} frames")
                return
            if end - at < head:
                need = head
                break
            lengths = struct.unpack_from(f"<{count}I", data, at + 4)
            size = head + sum(lengths)
            if size > MAX_MESSAGE_BYTES:
                self._broken(f"a message of {size} bytes")
                return
            if end - at < size:
                need = size
                break
            parts: list[memoryview] = []
            start = at + head
            for length in lengths:
                parts.append(view[start : start + length])
                start += length
            at += size
            self._link._deliver(parts)
        if at < end:
            self._rest += view[at:]
            self._need = need

    def _broken(self, what: str) -> None:
        log.error("link_protocol_broken", link=self._link.name, error=what)
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows: the peer counts as gone


class Link:
    """One end of an engine–gateway socket (see the module docstring). Event loop only."""

    def __init__(self, name: str, on_message: Callable[[list[memoryview]], None],
                 on_up: Callable[[], None] | None = None, on_down: Callable[[], None] | None = None) -> None:
        self.name = name
        self._on_message = on_message
        self._on_up = on_up
        self._on_down = on_down
        self._peer: _Protocol | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._queued: list[Sequence[Buffer]] | None = None  # sent before the connection was up
        self._closed = False

    # -- either end ----------------------------------------------------------------------------------
    async def listen(self, path: str) -> None:
        """The engine's end: bind ``path`` now (replacing a stale socket file) and take peers."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Protocol(self), path)

    def connect(self, path: str) -> None:
        """The gateway's end: connect to ``path`` in the background, trying again until it is there;
        what is sent meanwhile goes out, in order, once connected."""
        self._queued = []
        self._connecting = asyncio.get_running_loop().create_task(self._connect(path))

    async def _connect(self, path: str) -> None:
        loop = asyncio.get_running_loop()
        pause = _RETRY_S[0]
        while not self._closed:
            try:
                await loop.create_unix_connection(lambda: _Protocol(self), path)
                return
            except (FileNotFoundError, ConnectionRefusedError):  # the engine has not bound it yet
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RETRY_S[1])

    def send(self, parts: Sequence[Buffer]) -> bool:
        """Send one message (its frames); False (logged) if there is no peer to send it to."""
        peer = self._peer
        if peer is None or peer.transport is None or peer.transport.is_closing():
            if self._queued is not None and not self._closed:
                self._queued.append(parts)  # not connected yet
                return True
            log.error("link_send_failed", link=self.name, error="no peer connected")
            return False
        n = len(parts)
        head = _HEADS.get(n)
        if head is None:
            head = _HEADS[n] = struct.Struct(f"<I{n}I")
        sizes = [len(p) if type(p) is bytes else memoryview(p).nbytes for p in parts]
        peer.transport.writelines([head.pack(n, *sizes), *parts])
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop listening or connecting and close the connection (what was sent still goes out).
        Idempotent; ``on_down`` is not called for it."""
        if self._closed:
            return
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._server is not None:
            self._server.close()
        peer, self._peer = self._peer, None
        if peer is not None and peer.transport is not None:
            peer.transport.close()

    # -- from the connection -------------------------------------------------------------------------
    def _connected(self, peer: _Protocol) -> None:
        if self._closed or self._peer is not None:  # one peer at a time: a second one is turned away
            log.warning("link_peer_refused", link=self.name,
                        reason="closed" if self._closed else "a peer is already connected")
            assert peer.transport is not None
            peer.transport.abort()
            return
        self._peer = peer
        queued, self._queued = self._queued, None
        if self._on_up is not None:
            self._on_up()
        for parts in queued or ():
            self.send(parts)

    def _disconnected(self, peer: _Protocol) -> None:
        if peer is not self._peer:
            return  # one that was turned away, or the link was closed
        self._peer = None
        if self._on_down is not None:
            self._on_down()

    def _deliver(self, parts: list[memoryview]) -> None:
        try:
            self._on_message(parts)
        except Exception:  # one bad message must not stop the socket being read
            log.exception("channel_message_failed", channel=self.name)

