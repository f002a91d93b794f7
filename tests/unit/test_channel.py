"""The engine–gateway link: messages arrive whole and in order however the stream cuts them, what a
gateway sends before the engine listens is delivered once it does, and a peer's death is told at once."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

from coalesce.service.engine.channel import Link


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []
        self.arrived = asyncio.Event()

    def __call__(self, parts: list[memoryview]) -> None:
        self.messages.append([bytes(p) for p in parts])
        self.arrived.set()

    async def wait_for(self, count: int) -> list[list[bytes]]:
        while len(self.messages) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 10)
        return self.messages


async def _engine(path: str) -> tuple[Link, _Inbox]:
    """An engine's end listening on ``path``, and what it receives."""
    inbox = _Inbox()
    engine = Link("gateway-0", inbox)
    await engine.listen(path)
    return engine, inbox


def _wire(parts: list[bytes]) -> bytes:
    return struct.pack(f"<I{len(parts)}I", len(parts), *map(len, parts)) + b"".join(parts)


async def test_what_a_gateway_sends_before_the_engine_listens_arrives_in_order_once_it_does(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "gateway-0.sock")
    engine_in, gateway_in = _Inbox(), _Inbox()
    ups: list[str] = []
    gateway = Link("engine", gateway_in, on_up=lambda: ups.append("gateway"))
    gateway.connect(path)  # nothing listens yet: it tries again
    assert gateway.send([b"hello"]) and gateway.send([b"submit", b"\x00" * 70_000, b""])
    await asyncio.sleep(0.05)
    engine = Link("gateway-0", engine_in, on_up=lambda: ups.append("engine"))
    await engine.listen(path)
    try:
        got = await engine_in.wait_for(2)
        assert got == [[b"hello"], [b"submit", b"\x00" * 70_000, b""]]
        assert sorted(ups) == ["engine", "gateway"]
        assert engine.send([b"results", b"rows"])
        assert await gateway_in.wait_for(1) == [[b"results", b"rows"]]
    finally:
        gateway.close()
        engine.close()


async def test_messages_cut_anywhere_by_the_stream_arrive_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    engine, inbox = await _engine(path)
    messages = [[b"a"], [b"bb", b"ccc"], [b"d" * 1000, b"", b"e"], [b"f"]]
    stream = b"".join(_wire(m) for m in messages)
    _reader, writer = await asyncio.open_unix_connection(path)
    try:
        for cut in (1, 3, 5, 9, 700, len(stream)):  # a byte at a time, mid-header, mid-frame, ...
            inbox.messages.clear()
            for at in range(0, len(stream), cut):
                writer.write(stream[at : at + cut])
                await writer.drain()
                await asyncio.sleep(0)
            assert await inbox.wait_for(len(messages)) == messages, cut
    finally:
        writer.close()
        engine.close()


async def test_a_peer_that_goes_is_told_at_once_and_the_next_one_is_taken(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    downs: list[str] = []
    inbox = _Inbox()
    engine = Link("gateway-0", inbox, on_down=lambda: downs.append("engine"))
    await engine.listen(path)
    gateway = Link("engine", _Inbox(), on_down=lambda: downs.append("gateway"))
    gateway.connect(path)
    gateway.send([b"one"])
    await inbox.wait_for(1)
    gateway.close()  # the gateway process's socket closes
    for _ in range(200):
        if downs:
            break
        await asyncio.sleep(0.01)
    assert downs == ["engine"]  # (closing one's own end reports nothing to oneself)
    second = Link("engine", _Inbox())
    second.connect(path)
    second.send([b"two"])
    assert (await inbox.wait_for(2))[1] == [b"two"]
    engine.close()  # and the engine going is told to the gateway
    got: list[str] = []
    second._on_down = lambda: got.append("down")
    for _ in range(200):
        if got:
            break
        await asyncio.sleep(0.01)
    assert got == ["down"]
    second.close()


async def test_a_stream_that_breaks_the_framing_is_closed_as_a_peer_that_went(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    downs: list[bool] = []
    engine = Link("gateway-0", _Inbox(), on_down=lambda: downs.append(True))
    await engine.listen(path)
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(struct.pack("<I", 100_000))  # more frames than any message has
    try:
        closed = await asyncio.wait_for(reader.read(), 10) == b""
    except ConnectionResetError:
        closed = True
    assert closed and downs == [True]
    writer.close()
    engine.close()


async def test_a_large_message_arriving_in_pieces_is_delivered_once_whole(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    engine, inbox = await _engine(path)
    rows = bytes(range(256)) * 16_384  # 4 MiB: many reads, joined once
    stream = _wire([b"results", rows]) + _wire([b"next"])
    _reader, writer = await asyncio.open_unix_connection(path)
    try:
        for at in range(0, len(stream), 65_536):
            writer.write(stream[at : at + 65_536])
            await writer.drain()
        assert await inbox.wait_for(2) == [[b"results", rows], [b"next"]]
    finally:
        writer.close()
        engine.close()
