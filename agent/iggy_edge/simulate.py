"""Simulated sensors for the demo and the benchmarks: a few devices that
publish realistic telemetry (temperature, humidity, pressure drifting slowly,
with the device's own sequence number) over MQTT, the way the example
firmware does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field

import gmqtt
from gmqtt.mqtt.constants import MQTTv311

from .timeouts import wait_for
from .topics import DEFAULT, TopicLayout


@dataclass
class SimulatedSensor:
    device_id: str
    rate_hz: float = 2.0
    qos: int = 1
    seq: int = 0
    sent: int = 0
    topics: TopicLayout = DEFAULT  # the gateway's (settings.topics)
    _phase: float = field(default_factory=lambda: random.uniform(0, 6.28))  # noqa: S311

    @property
    def topic(self) -> str:
        """Where its readings go: the ``env`` channel of its ``up/`` tree."""
        return self.topics.up(self.device_id, "env")

    def reading(self) -> bytes:
        t = time.time()
        self.seq += 1
        body = {
            "seq": self.seq,
            "ts": round(t, 3),
            "temp_c": round(21.0 + 3 * math.sin(t / 300 + self._phase) + random.gauss(0, 0.05), 2),
            "rh": round(45 + 10 * math.sin(t / 900 + self._phase), 1),
            "hpa": round(1013 + 4 * math.sin(t / 3600 + self._phase), 1),
        }
        return json.dumps(body, separators=(",", ":")).encode()

    async def run(self, host: str, port: int, stop: asyncio.Event) -> None:
        status = self.topics.status(self.device_id)
        client = gmqtt.Client(
            f"sim-{self.device_id}", will_message=gmqtt.Message(status, b"offline", qos=1, retain=True)
        )
        client.set_config({"reconnect_retries": -1, "reconnect_delay": 1})
        try:
            await client.connect(host, port, version=MQTTv311)
            client.publish(status, b"online", qos=1, retain=True)
            period = 1.0 / self.rate_hz
            while not stop.is_set():
                client.publish(self.topic, self.reading(), qos=self.qos)
                self.sent += 1
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), period * random.uniform(0.9, 1.1))  # noqa: S311
        finally:
            await client.disconnect()
