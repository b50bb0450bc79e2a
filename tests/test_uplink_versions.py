"""What the agent says when the endpoint does not speak apache-iggy 0.9's
protocol (Iggy 0.10 changed it): a real SDK client against endpoints that
accept TCP and then close, answer junk or stay silent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from iggy_edge.config import IggySettings
from iggy_edge.uplink.iggy import IggyUplink
from iggy_edge.uplink.protocol import UplinkUnavailable
from pydantic import SecretStr

from tests.support.ports import free_port

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


@pytest.fixture
async def endpoint(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    handler: Handler = request.param
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
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
    )


@pytest.mark.parametrize("endpoint", [close_at_once, answer_junk, stay_silent], indirect=True)
async def test_an_endpoint_speaking_another_protocol_is_named(endpoint: str) -> None:
    up = IggyUplink(settings(endpoint), "gw-1")
    with pytest.raises(UplinkUnavailable) as info:
        await up.start()
    await up.close()
    assert "iggy-server 0.9.x" in str(info.value)
    assert "0.10" in str(info.value)


async def test_a_closed_port_is_just_unreachable() -> None:
    up = IggyUplink(settings(f"127.0.0.1:{free_port()}"), "gw-1")
    with pytest.raises(UplinkUnavailable) as info:
        await up.start()
    await up.close()
    assert "0.9.x" not in str(info.value)
