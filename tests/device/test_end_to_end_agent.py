"""End to end: the env_sensor firmware under the MicroPython Unix port ->
Mosquitto -> the agent (in-process, its real runtime) -> the in-memory Iggy
uplink.

The way back (a command published to the gateway's Iggy topic, delivered to
the device, acked, the ack forwarded) is not here yet: runtime.Agent accepts
a command_source but does not start the return path at the time of writing.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from iggy_edge.uplink.memory import MemoryIggy
from iggy_edge.uplink.protocol import PolledMessage

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.micropython import Board, Flash, require_micropython
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.micropython


def _all(iggy: MemoryIggy, topic: str, partitions: int) -> list[PolledMessage]:
    if ("edge", topic) not in iggy.topics:
        return []
    return [m for p in range(partitions) for m in iggy.messages("edge", topic, p)]


async def test_sensor_firmware_to_agent_to_uplink(tmp_path: Path, broker: Broker) -> None:
    require_micropython()
    dev = f"e2e-{uuid.uuid4().hex[:8]}"
    iggy = MemoryIggy()
    settings = make_settings(tmp_path, broker, gateway_id="gw-e2e")
    parts = settings.iggy.partitions
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "env_sensor",
        device_id=dev,
        broker=broker.host,
        port=broker.port,
        period_ms=20,
        backoff_base_ms=100,
        backoff_max_ms=800,
    )
    board = Board(flash)

    def of_device(topic: str, mqtt_topic: str) -> list[PolledMessage]:
        return [m for m in _all(iggy, topic, parts) if m.headers.get("mqtt-topic") == mqtt_topic]

    async with running_agent(settings, iggy.uplink()):
        board.start()
        try:
            await async_wait_until(
                lambda: len(of_device("telemetry", f"edge/{dev}/up/env")) >= 100,
                30,
                what="100 readings in Iggy",
            )
        finally:
            board.stop()
    env = of_device("telemetry", f"edge/{dev}/up/env")
    seqs = [int(m.headers["device-seq"]) for m in env]
    assert seqs == sorted(set(seqs))  # one device, one partition key: in order, once each
    assert [json.loads(m.payload)["seq"] for m in env] == seqs  # the agent read the device's seq
    assert all(m.headers["gateway-id"] == "gw-e2e" for m in env)
    assert all(json.loads(m.payload)["sim"] == 1 for m in env)
    assert [m.payload for m in of_device("events", f"edge/{dev}/status")][:1] == [b"online"]
