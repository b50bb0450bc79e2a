"""Versions at the wire: what the agent says when the endpoint does not speak
apache-iggy 0.9's protocol, and the CREATE_TOPIC requests it sends.

A real SDK client against endpoints we own (tests/support/vsr_fake.py): a
server of another binary-protocol version (evicts the login, as a real
0.9.0-edge.5 server does for a version outside its window -- checked below
against the real server), iggy-server 0.8's 8-byte framing, and endpoints
that close, answer junk or stay silent.  Topic creation: the request for a
server that knows the durability keys (released 0.9.0; no such server here)
and the fallback for 0.9.0-edge.5, which refuses them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from iggy_edge.config import IggySettings
from iggy_edge.uplink.iggy import PERSIST_OPTIONS, IggyUplink, encode_create_topic
from iggy_edge.uplink.iggy.errors import IncompatibleServer
from iggy_edge.uplink.protocol import UplinkUnavailable
from pydantic import SecretStr

from tests.support.iggy_server import IggyServer
from tests.support.ports import free_port
from tests.support.vsr_fake import (
    CLIENT_AT,
    COMMAND_AT,
    COMMAND_EVICTION,
    EVICTION_INCOMPATIBLE_PROTOCOL,
    HEADER,
    OP_REGISTER,
    OPERATION_AT,
    SIZE_AT,
    VsrFake,
    pack_version,
    unpack_version,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(4096)
    writer.close()


async def answer_junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(4096)
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    writer.close()


async def stay_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(4096)
    await reader.read(4096)  # until the client gives up and closes
    writer.close()


async def legacy_framing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """iggy-server 0.8 (apache/iggy server-0.8.0, tcp/connection_handler.rs):
    8-byte request frames [length u32][code u32]; a length below 4 is
    answered with the error frame [status = InvalidCommand (3)][length 0]
    and the next 8 bytes are read; otherwise it waits for the payload."""
    while True:
        head = await reader.readexactly(8)
        length, _code = struct.unpack("<II", head)
        if length < 4:
            writer.write(struct.pack("<II", 3, 0))
            await writer.drain()
            continue
        await reader.readexactly(length - 4)


@pytest.fixture
async def endpoint(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    handler: Handler = request.param
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await handler(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for w in writers:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        await server.wait_closed()


def settings(address: str) -> IggySettings:
    return IggySettings(
        kind="iggy",
        address=address,
        password=SecretStr("long-enough-password"),
        connect_timeout_s=1.0,
        request_timeout_s=1.0,
        partitions=3,
    )


@pytest.mark.parametrize("endpoint", [close_at_once, answer_junk, stay_silent, legacy_framing], indirect=True)
async def test_an_endpoint_speaking_another_protocol_is_named(endpoint: str) -> None:
    up = IggyUplink(settings(endpoint), "gw-1")
    with pytest.raises(UplinkUnavailable) as info:
        await up.start()
    await up.close()
    assert "iggy-server 0.9.x" in str(info.value)
    assert "another Iggy release" in str(info.value)


async def test_a_server_of_another_protocol_version_is_named_with_both_versions() -> None:
    async with VsrFake(protocol_minor=12) as server:
        up = IggyUplink(settings(server.address), "gw-1")
        with pytest.raises(IncompatibleServer) as info:
            await up.start()
        await up.close()
    text = str(info.value)
    assert server.client_versions[0][0] == (0, 11, 0)  # what SDK 0.9.0 sends
    assert f"{server.address} speaks another Iggy protocol version" in text
    assert "accepts binary protocol 0.12.0" in text
    assert "apache-iggy 0.9.0 speaks 0.11.0" in text
    assert "works with iggy-server 0.9.x" in text
    assert isinstance(info.value, UplinkUnavailable)  # nothing stored: retried with backoff


async def test_the_same_fake_at_the_agents_version_lets_the_login_through() -> None:
    # The eviction above is the version check, not the fake refusing everything.
    async with VsrFake(protocol_minor=11) as server:
        up = IggyUplink(settings(server.address), "gw-1")
        await up.start()
        await up.close()
    assert server.client_versions == [((0, 11, 0), "rust-sdk", "0.11.0")]


async def _raw_register(address: str, protocol: int) -> bytes:
    """A Register request carrying `protocol`, as the SDK frames it; returns
    the server's 256-byte answer header."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        name, version, user, password = b"rust-sdk", b"0.11.0", b"iggy", b"iggy-edge-test-secret"
        body = (
            struct.pack("<I", protocol)
            + bytes((len(name),))
            + name
            + bytes((len(version),))
            + version
            + bytes((len(user),))
            + user
            + bytes((len(password),))
            + password
            + struct.pack("<I", 0)
        )
        head = bytearray(HEADER)
        struct.pack_into("<I", head, SIZE_AT, HEADER + len(body))
        head[COMMAND_AT] = 5  # Request
        head[CLIENT_AT : CLIENT_AT + 16] = os.urandom(16)
        head[OPERATION_AT] = OP_REGISTER
        writer.write(bytes(head) + body)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(HEADER), 10)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.iggy
async def test_a_real_server_evicts_another_protocol_version_as_the_fake_does(
    iggy_server: IggyServer,
) -> None:
    answer = await _raw_register(iggy_server.address, pack_version(0, 12, 0))
    assert answer[COMMAND_AT] == COMMAND_EVICTION
    assert answer[255] == EVICTION_INCOMPATIBLE_PROTOCOL
    high, low = struct.unpack_from("<II", answer, 144)
    assert unpack_version(low) == unpack_version(high) == (0, 11, 0)  # edge.5's window


async def test_topic_creation_for_a_server_that_knows_the_durability_keys() -> None:
    # Released 0.9.0: the SDK's own request with the durability keys, nothing else.
    async with VsrFake() as server:
        up = IggyUplink(settings(server.address), "gw-1", topics=[("edge", "telemetry")])
        await up.start()
        await up.close()
    durable = [("consumer_offset_durability", "replicated"), ("durability", "persisted")]
    assert [r.body for r in server.create_topic_requests] == [
        encode_create_topic("edge", "telemetry", 3, durable)
    ]
    assert server.topics == {("edge", "telemetry"): 3}


async def test_topic_creation_for_a_server_that_refuses_them_falls_back_to_fsync_options() -> None:
    # 0.9.0-edge.5 answers UnsupportedOptionKey; the raw request asks for fsync.
    keys = frozenset(k for k, _ in PERSIST_OPTIONS)
    async with VsrFake(known_option_keys=keys) as server:
        up = IggyUplink(settings(server.address), "gw-1", topics=[("edge", "telemetry")])
        await up.start()
        await up.close()
    assert [r.options for r in server.create_topic_requests] == [
        [("consumer_offset_durability", "replicated"), ("durability", "persisted")],
        list(PERSIST_OPTIONS),
    ]
    assert server.create_topic_requests[1].body == encode_create_topic(
        "edge", "telemetry", 3, PERSIST_OPTIONS
    )


async def test_a_closed_port_is_just_unreachable() -> None:
    up = IggyUplink(settings(f"127.0.0.1:{free_port()}"), "gw-1")
    with pytest.raises(UplinkUnavailable) as info:
        await up.start()
    await up.close()
    assert "0.9.x" not in str(info.value)
