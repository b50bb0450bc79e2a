"""The demo's simulated sensors publish under the gateway's topic layout
(topics.py), never a spelled ``edge/...``."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import gmqtt
from iggy_edge.simulate import SimulatedSensor
from iggy_edge.topics import TopicLayout

from tests.support.broker import Broker
from tests.support.wait import async_wait_until


async def test_sensor_publishes_status_and_readings_under_the_layouts_prefix(broker: Broker) -> None:
    layout = TopicLayout("site-7/edge")
    seen: list[str] = []
    watcher = gmqtt.Client(f"watcher-{uuid.uuid4().hex[:8]}", clean_session=True)

    def on_message(_client: gmqtt.Client, topic: str, _payload: bytes, _qos: int, _props: object) -> int:
        seen.append(topic)
        return 0

    watcher.on_message = on_message
    await watcher.connect("127.0.0.1", broker.port)
    watcher.subscribe("#", qos=1)
    sensor = SimulatedSensor("sensor-00", rate_hz=20, topics=layout)
    assert sensor.topic == "site-7/edge/sensor-00/up/env"
    stop = asyncio.Event()
    task = asyncio.create_task(sensor.run("127.0.0.1", broker.port, stop))
    try:
        await async_wait_until(lambda: seen.count(sensor.topic) >= 3, what="three readings")
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await watcher.disconnect()
    assert layout.status("sensor-00") in seen
    assert not [t for t in seen if not t.startswith("site-7/edge/sensor-00/")]
