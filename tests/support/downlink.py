"""Stand-ins for the return-path tests: a device subscriber and a TCP proxy.

`DeviceSubscriber` is a real gmqtt client subscribed to a device's
``down/#`` topics (what a device would do); it records every message with
its retain flag.  `FreezableProxy` sits between the agent's deliver client
and Mosquitto and can hold back the broker's replies (PUBACKs), which puts
the agent exactly between "the broker has the command" and "the agent knows".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge.config import Settings, parse_config

from .broker import Broker
from .ports import free_port


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def downlink_settings(tmp_path: Path, broker: Broker | None = None, **overrides: Any) -> Settings:
    """Settings for return-path tests: private state dir, the test's broker,
    memory Iggy, fast polling and backoff; the real environment is ignored."""
    raw: dict[str, Any] = {
        "gateway_id": "gw-test",
        "state_dir": str(tmp_path / "state"),
        "mqtt": {"reconnect_min_s": 0.05, "reconnect_max_s": 0.3},
        "iggy": {"kind": "memory", "partitions": 3},
        "forward": {"linger_ms": 5, "backoff_initial_s": 0.05, "backoff_max_s": 0.2},
        "downlink": {"poll_interval_s": 0.05, "publish_timeout_s": 3.0},
        "metrics": {"enabled": False},
    }
    if broker is not None:
        raw["mqtt"].update({"host": broker.host, "port": broker.port})
    return parse_config(_merge(raw, overrides), source="test", env={})


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool

    @property
    def doc(self) -> Any:
        return json.loads(self.payload)


@dataclass
class DeviceSubscriber:
    host: str
    port: int
    filter: str
    client_id: str = field(default_factory=lambda: f"device-{uuid.uuid4().hex[:8]}")
    messages: list[Received] = field(default_factory=list)
    _client: gmqtt.Client | None = None

    async def start(self) -> DeviceSubscriber:
        client = gmqtt.Client(self.client_id, clean_session=True)
        subscribed = asyncio.get_running_loop().create_future()
        client.on_message = self._on_message
        client.on_subscribe = lambda *_: subscribed.done() or subscribed.set_result(None)  # type: ignore[func-returns-value]
        self._client = client
        try:
            await client.connect(self.host, self.port, version=MQTTv50)
            client.subscribe(self.filter, qos=1)
            await asyncio.wait_for(subscribed, 5)
        except BaseException:
            await self.stop()
            raise
        return self

    def _on_message(
        self, client: Any, topic: str, payload: bytes, qos: int, properties: dict[str, Any]
    ) -> int:
        self.messages.append(Received(topic, payload, bool(properties.get("retain"))))
        return 0

    def ids(self) -> list[str]:
        return [m.doc["id"] for m in self.messages if m.topic.endswith("/down/cmd")]

    async def stop(self) -> None:
        if self._client is not None:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                await asyncio.wait_for(self._client.disconnect(), 5)
            self._client = None


class FreezableProxy:
    """TCP proxy to the broker.  `freeze_replies()` stops forwarding the
    broker's bytes to the client (they are discarded, as if lost on the way,
    so use it just before the client is killed or the connection cut);
    `close_all()` cuts every connection."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.frozen = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> FreezableProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    def freeze_replies(self) -> None:
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]
        to_broker = asyncio.create_task(self._pipe(reader, up_writer, gated=False))
        to_client = asyncio.create_task(self._pipe(up_reader, writer, gated=True))
        self._tasks |= {to_broker, to_client}
        await asyncio.wait({to_broker, to_client}, return_when=asyncio.FIRST_COMPLETED)
        for t in (to_broker, to_client):
            t.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if gated and self.frozen.is_set():
                    continue  # lost: the client never sees these bytes
                writer.write(data)
                await writer.drain()

    def close_all(self) -> None:
        for w in self._writers:
            w.close()
        self._writers.clear()

    async def stop(self) -> None:
        self.close_all()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in self._tasks:
            t.cancel()
