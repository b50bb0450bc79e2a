"""A minimal MQTT 3.1.1 publisher that knows which messages the broker acknowledged.

Tests need exactly one fact a general client hides: which QoS1 PUBLISHes the
*broker* answered with PUBACK (the broker took responsibility for them).
This speaks the few packets needed (CONNECT, PUBLISH, PUBACK, DISCONNECT)
with the agent's own codec (iggy_edge.mqtt_codec, tested against the spec in
tests/test_mqtt_codec.py) on an asyncio stream, so every acknowledgement is
observed, not assumed.  It is a real client talking to the real broker, not a
test double.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from iggy_edge import mqtt_codec as codec


def agent_transport(client: Any) -> asyncio.Transport:
    """The socket under a live gmqtt session of the agent: tests abort it (a
    dead process) or count its writes."""
    conn = client._package_handler.current_connection  # noqa: SLF001 - the real socket, for tests only
    transport: asyncio.Transport = conn._transport  # noqa: SLF001 - as above
    return transport


class Publisher:
    """QoS0/1 publisher.  `acked` holds the tag of every message the broker
    acknowledged (PUBACK), in acknowledgement order."""

    def __init__(self, host: str, port: int, client_id: str, *, max_inflight: int = 500) -> None:
        self.host = host
        self.port = port
        self.client_id = client_id
        self.acked: list[Any] = []
        self._inflight: dict[int, Any] = {}
        self._slots = asyncio.Semaphore(max_inflight)
        self._next_id = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._drained = asyncio.Event()
        self._drained.set()

    async def connect(self, timeout: float = 5.0) -> Publisher:
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), timeout
        )
        assert self._reader is not None
        assert self._writer is not None
        self._writer.write(codec.connect(self.client_id, keepalive=60))
        head = await asyncio.wait_for(self._reader.readexactly(4), timeout)
        if head[0] != codec.CONNACK or codec.parse_connack(head[2:])[1] != 0:
            raise ConnectionError(f"CONNACK refused: {head!r}")
        self._task = asyncio.create_task(self._read_loop(), name=f"publisher-{self.client_id}")
        return self

    async def _read_loop(self) -> None:
        assert self._reader is not None
        splitter = codec.Splitter()
        while True:
            try:
                chunk = await self._reader.read(65536)
            except ConnectionError:
                return
            if not chunk:
                return
            for first, body in splitter.feed(chunk):
                if first & 0xF0 == codec.PUBACK:
                    pid, _ = codec.parse_ack(body)
                    if pid in self._inflight:
                        self.acked.append(self._inflight.pop(pid))
                        self._slots.release()
                    if not self._inflight:
                        self._drained.set()

    async def publish(
        self, topic: str | bytes, payload: bytes, *, qos: int = 1, retain: bool = False, tag: Any = None
    ) -> None:
        """Send one PUBLISH; for QoS1 the ack is recorded in `acked` as `tag`."""
        assert self._writer is not None
        mid = 0
        if qos:
            # bounded: a broker that stops acknowledging fails the test instead of hanging it
            await asyncio.wait_for(self._slots.acquire(), 30)
            self._next_id = self._next_id % 65535 + 1
            while self._next_id in self._inflight:
                self._next_id = self._next_id % 65535 + 1
            mid = self._next_id
            self._inflight[mid] = tag
            self._drained.clear()
        self._writer.write(codec.publish(topic, payload, qos=qos, mid=mid, retain=retain))
        await self._writer.drain()

    async def wait_all_acked(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._drained.wait(), timeout)

    async def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                self._writer.write(codec.DISCONNECT_PACKET)
                await self._writer.drain()
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def publish_all(
    host: str,
    port: int,
    client_id: str,
    messages: list[tuple[str, bytes]],
    *,
    qos: int = 1,
    retain: bool = False,
) -> None:
    """Publish a list of (topic, payload) and wait until the broker acknowledged all."""
    pub = await Publisher(host, port, client_id).connect()
    try:
        for topic, payload in messages:
            await pub.publish(topic, payload, qos=qos, retain=retain)
        if qos:
            await pub.wait_all_acked(timeout=30)
    finally:
        await pub.close()
