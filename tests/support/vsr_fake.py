"""A tiny Iggy server at the wire, for what no real server here can show.

The apache-iggy 0.9.0 SDK frames every request in a 256-byte VSR
`RequestHeader` (apache/iggy ``core/binary_protocol/src/consensus/header.rs``)
and logs in with a Register request whose body starts with its
`ClientVersionInfo` (``core/binary_protocol/src/version.rs``): packed binary
protocol version u32 (``major << 20 | minor << 10 | patch``; SDK 0.9.0 sends
0.11.0), SDK name, SDK version.  A server whose protocol window does not hold
that version answers with a header-only `Eviction` frame: command 13, reason
`IncompatibleProtocol` (14) at byte 255, the accepted window (max, min) at
bytes 144 and 148.  `iggy-server` 0.9.0-edge.5 answers a raw Register of
0.12.0 exactly so (window 0.11.0-0.11.0; ``tests/test_uplink_versions.py``
checks it against the real server), which is how a server of a later,
wire-incompatible release turns this SDK away.

`VsrFake` speaks just enough of that protocol for the tests:

* ping and the cluster-metadata read after login: an empty reply;
* Register: accepted, or, with ``protocol_minor`` set, evicted as a server of
  that binary-protocol minor would;
* GET_TOPIC / CREATE_STREAM / CREATE_TOPIC over an in-memory catalogue, the
  CREATE_TOPIC bodies recorded as sent, and refused with
  UnsupportedOptionKey when ``known_option_keys`` does not hold every key (as
  0.9.0-edge.5 refuses the durability keys).

Field offsets are the ones the header structs pin in apache/iggy; nothing of
apache/iggy is copied here.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

HEADER: Final = 256
SIZE_AT: Final = 48
COMMAND_AT: Final = 60
CLIENT_AT: Final = 128  # RequestHeader.client, u128
REQUEST_AT: Final = 168  # RequestHeader.request, u64
OPERATION_AT: Final = 176  # RequestHeader.operation, u8
CODE_AT: Final = 196  # RequestHeader.reserved[0..4]: a non-replicated request's code

COMMAND_REPLY: Final = 8
COMMAND_EVICTION: Final = 13
OP_REGISTER: Final = 1
OP_NON_REPLICATED: Final = 2
OP_CREATE_STREAM: Final = 128
OP_CREATE_TOPIC: Final = 132
GET_TOPIC_CODE: Final = 300
EVICTION_INCOMPATIBLE_PROTOCOL: Final = 14

# IggyError codes (core/common/src/error/iggy_error.rs)
STREAM_NAME_ALREADY_EXISTS: Final = 1012
TOPIC_NAME_NOT_FOUND: Final = 2011
TOPIC_NAME_ALREADY_EXISTS: Final = 2013
UNSUPPORTED_OPTION_KEY: Final = 4041


def pack_version(major: int, minor: int, patch: int) -> int:
    return major << 20 | minor << 10 | patch


def unpack_version(packed: int) -> tuple[int, int, int]:
    return packed >> 20, (packed >> 10) & 1023, packed & 1023


def decode_identifier(buf: bytes, pos: int) -> tuple[str, int]:
    kind, n = buf[pos], buf[pos + 1]
    raw = buf[pos + 2 : pos + 2 + n]
    value = raw.decode() if kind == 2 else str(int.from_bytes(raw, "little"))
    return value, pos + 2 + n


def decode_options(buf: bytes) -> list[tuple[str, str]]:
    """The options block: (key kind u8, key len u32, key, value kind u8,
    value len u32, value) to the end."""
    out, pos = [], 0
    while pos < len(buf):
        (klen,) = struct.unpack_from("<I", buf, pos + 1)
        key = buf[pos + 5 : pos + 5 + klen].decode()
        pos += 5 + klen
        (vlen,) = struct.unpack_from("<I", buf, pos + 1)
        value = buf[pos + 5 : pos + 5 + vlen].decode()
        pos += 5 + vlen
        out.append((key, value))
    return out


@dataclass(frozen=True)
class CreateTopic:
    stream: str
    topic: str
    partitions: int
    options: list[tuple[str, str]]
    body: bytes


def decode_create_topic(body: bytes) -> CreateTopic:
    stream, pos = decode_identifier(body, 0)
    (partitions,) = struct.unpack_from("<I", body, pos)
    n = body[pos + 4]
    topic = body[pos + 5 : pos + 5 + n].decode()
    return CreateTopic(stream, topic, partitions, decode_options(body[pos + 5 + n :]), body)


@dataclass
class VsrFake:
    protocol_minor: int | None = None  # None: accept every login
    known_option_keys: frozenset[str] | None = None  # None: every key
    create_topic_requests: list[CreateTopic] = field(default_factory=list)
    client_versions: list[tuple[tuple[int, int, int], str, str]] = field(default_factory=list)
    topics: dict[tuple[str, str], int] = field(default_factory=dict)
    address: str = ""  # host:port once entered
    _server: asyncio.Server | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def __aenter__(self) -> VsrFake:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readexactly(HEADER)
                (size,) = struct.unpack_from("<I", head, SIZE_AT)
                body = await reader.readexactly(size - HEADER)
                writer.write(self._answer(head, body))
                await writer.drain()
        writer.close()

    def _answer(self, head: bytes, body: bytes) -> bytes:
        client, request, op = (
            head[CLIENT_AT : CLIENT_AT + 16],
            head[REQUEST_AT : REQUEST_AT + 8],
            head[OPERATION_AT],
        )
        if op == OP_REGISTER:
            (packed,) = struct.unpack_from("<I", body, 0)
            n = body[4]
            name = body[5 : 5 + n].decode()
            m = body[5 + n]
            version = body[6 + n : 6 + n + m].decode()
            self.client_versions.append((unpack_version(packed), name, version))
            if self.protocol_minor is not None and unpack_version(packed)[1] != self.protocol_minor:
                return eviction(client, pack_version(0, self.protocol_minor, 0))
            # LoginRegisterResponse: user_id u32, session u64, protocol u32, server version
            login = struct.pack("<IQI", 1, 1, packed) + bytes((5,)) + b"0.9.0"
            return reply(client, request, op, struct.pack("<I", 0) + login)
        if op == OP_NON_REPLICATED:
            (code,) = struct.unpack_from("<I", head, CODE_AT)
            if code == GET_TOPIC_CODE:
                stream, pos = decode_identifier(body, 0)
                topic, _ = decode_identifier(body, pos)
                partitions = self.topics.get((stream, topic))
                if partitions is None:
                    return reply(client, request, op, status=TOPIC_NAME_NOT_FOUND)
                return reply(client, request, op, topic_details(topic, partitions))
            return reply(client, request, op)  # ping, cluster metadata: empty
        if op == OP_CREATE_STREAM:
            return reply(client, request, op, rejection(STREAM_NAME_ALREADY_EXISTS))
        if op == OP_CREATE_TOPIC:
            create = decode_create_topic(body)
            self.create_topic_requests.append(create)
            keys = {k for k, _ in create.options}
            if self.known_option_keys is not None and not keys <= self.known_option_keys:
                return reply(client, request, op, rejection(UNSUPPORTED_OPTION_KEY))
            if (create.stream, create.topic) in self.topics:
                return reply(client, request, op, rejection(TOPIC_NAME_ALREADY_EXISTS))
            self.topics[(create.stream, create.topic)] = create.partitions
            return reply(
                client, request, op, struct.pack("<I", 0) + topic_details(create.topic, create.partitions)
            )
        return reply(client, request, op, rejection(UNSUPPORTED_OPTION_KEY))


def reply(client: bytes, request: bytes, op: int, body: bytes = b"", status: int = 0) -> bytes:
    """A ReplyHeader (client @160, request @200, operation @208, status @216) and body."""
    head = bytearray(HEADER)
    struct.pack_into("<I", head, SIZE_AT, HEADER + len(body))
    head[COMMAND_AT] = COMMAND_REPLY
    head[160:176] = client
    head[200:208] = request
    head[208] = op
    struct.pack_into("<I", head, 216, status)
    return bytes(head) + body


def rejection(code: int) -> bytes:
    """A metadata reply's result section with one rejected entry."""
    return struct.pack("<III", 1, 0, code)


def eviction(client: bytes, window: int) -> bytes:
    """Header-only Eviction, reason IncompatibleProtocol, window [window, window]."""
    head = bytearray(HEADER)
    struct.pack_into("<I", head, SIZE_AT, HEADER)
    head[COMMAND_AT] = COMMAND_EVICTION
    head[CLIENT_AT : CLIENT_AT + 16] = client
    struct.pack_into("<II", head, 144, window, window)
    head[255] = EVICTION_INCOMPATIBLE_PROTOCOL
    return bytes(head)


def topic_details(name: str, partitions: int) -> bytes:
    """GetTopicResponse: TopicHeader, then 40 bytes per partition."""
    raw = name.encode()
    header = (
        struct.pack("<IQIQBQQQ", 1, 0, partitions, 0, 1, 0, 0, 0)
        + bytes((len(raw),))
        + raw
        + struct.pack("<II", 0, 0)
    )
    return header + b"".join(struct.pack("<IQIQQQ", i, 0, 1, 0, 0, 0) for i in range(partitions))


@contextlib.contextmanager
def vsr_fake_in_thread(fake: VsrFake) -> Iterator[VsrFake]:
    """`fake` served from an event loop of its own, for synchronous tests
    (the CLI's CliRunner runs its own loop)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="vsr-fake", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fake.__aenter__(), loop).result(10)
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(fake.__aexit__(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
