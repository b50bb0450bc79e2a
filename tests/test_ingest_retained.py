"""Retained messages are ingested once per subscription, not once per reconnect."""

from __future__ import annotations

import asyncio
from pathlib import Path

from iggy_edge.uplink.memory import MemoryIggy

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.wait import async_wait_until


def _status_topics(iggy: MemoryIggy) -> list[str]:
    n = len(iggy.topics.get(("edge", "events"), []))
    return sorted(m.headers["mqtt-topic"] for i in range(n) for m in iggy.messages("edge", "events", i))


async def _publish(broker: Broker, topic: str, *flags: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "mosquitto_pub", "-p", str(broker.port), "-t", topic, "-m", "online", "-q", "1", *flags
    )
    assert await proc.wait() == 0


async def test_retained_status_is_not_reingested_on_every_reconnect(tmp_path: Path, broker: Broker) -> None:
    retained = "edge/ret-dev-1/status"
    live = "edge/ret-dev-2/status"
    await _publish(broker, retained, "-r")
    settings = make_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with running_agent(settings, iggy.uplink()):
        # a new subscription: the retained status arrives, once
        await async_wait_until(lambda: _status_topics(iggy) == [retained], 10, what="retained status")
    # the same persistent session subscribes again on connect: no second copy
    async with running_agent(settings, iggy.uplink()):
        await _publish(broker, live)
        await async_wait_until(lambda: live in _status_topics(iggy), 10, what="live status")
    assert _status_topics(iggy) == sorted([retained, live])
