"""A connect that fails after the TCP connection was made must not leave its
socket open: a peer that accepts TCP and never sends CONNACK, the connect
given up on (timeout) or cancelled (the agent stopping).  gmqtt keeps that
socket in the client, and only its `disconnect()` closes it; `is_connected`
stays False until the CONNACK, so a close guarded by it leaked the socket
until the garbage collector found it (a CI run failed on that ResourceWarning
in an unrelated test).  Each test watches the peer: it must see the
connection closed while the client object is still alive."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import gmqtt
import pytest
from iggy_edge import mqttconn
from iggy_edge.broker_checks import check_broker
from iggy_edge.config import MqttSettings, parse_config
from iggy_edge.gmqtt_hooks import own_reconnect

pytestmark = pytest.mark.unit


class SilentPeer:
    """Accepts TCP, reads whatever comes, never answers; `closed` is set
    when the client's side of the connection is closed (EOF)."""

    def __init__(self) -> None:
        self.accepted = asyncio.Event()
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted.set()
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass
        self.closed.set()
        writer.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])


@contextlib.asynccontextmanager
async def silent_peer() -> AsyncIterator[SilentPeer]:
    peer = SilentPeer()
    peer.server = await asyncio.start_server(peer.serve, "127.0.0.1", 0)
    try:
        yield peer
    finally:
        peer.server.close()
        await peer.server.wait_closed()


def _mqtt(port: int) -> MqttSettings:
    return MqttSettings(host="127.0.0.1", port=port)


def _client() -> gmqtt.Client:
    client = gmqtt.Client("leak-check", clean_session=True)
    own_reconnect(client, lambda: None)
    return client


async def test_connect_that_times_out_closes_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mqttconn, "CONNECT_TIMEOUT_S", 0.3)
    async with silent_peer() as peer:
        client = _client()
        with pytest.raises(TimeoutError):
            await mqttconn.connect(client, _mqtt(peer.port))
        await asyncio.wait_for(peer.closed.wait(), 2)
        del client


async def test_cancelled_connect_closes_its_socket() -> None:
    async with silent_peer() as peer:
        client = _client()
        task = asyncio.create_task(mqttconn.connect(client, _mqtt(peer.port)))
        await asyncio.wait_for(peer.accepted.wait(), 2)
        await asyncio.sleep(0.05)  # the CONNECT is out, the CONNACK awaited
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(peer.closed.wait(), 2)
        del client


async def test_doctor_against_a_silent_peer_closes_its_socket(tmp_path: Path) -> None:
    async with silent_peer() as peer:
        settings = parse_config(
            {
                "gateway_id": "gw",
                "state_dir": str(tmp_path),
                "mqtt": {"host": "127.0.0.1", "port": peer.port},
            },
            env={},
        )
        check = await check_broker(settings, timeout=0.5)
        assert check.status == "fail"
        assert "accepts TCP but no MQTT session" in check.detail
        await asyncio.wait_for(peer.closed.wait(), 2)
