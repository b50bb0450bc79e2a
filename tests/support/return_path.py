"""A running agent with a MemoryIggy as the return path's command source, and
the small helpers the return-path tests share (send like the cloud side,
a device subscriber, a device's publish, the inbox's states and offsets)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge.config import Settings
from iggy_edge.downlink.commands import (
    KIND_COMMAND,
    KIND_CONFIG,
    KIND_HEADER,
    Command,
    DesiredConfig,
    return_topic,
)
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.poll import ReturnPoll
from iggy_edge.inbox_admin import read_commands, read_offsets
from iggy_edge.metrics import Metrics
from iggy_edge.runtime import build_agent
from iggy_edge.store.outbox import Outbox
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.memory import MemoryIggy

from .broker import Broker
from .downlink import DeviceSubscriber, Received


def states(settings: Settings) -> dict[str, str]:
    """Command id -> state, in arrival order (the CLI lists newest first)."""
    return {r.id: r.state for r in reversed(read_commands(settings.buffer_path, limit=10_000))}


def provision(iggy: MemoryIggy, settings: Settings) -> None:
    """What `iggy-edge cloud provision-gateway` does for the agent: its
    return-path topic, one partition (the agent never creates it)."""
    rt = return_topic(settings)
    iggy.create_topic(rt.stream, rt.topic, 1)


def send(iggy: MemoryIggy, settings: Settings, msg: Command | DesiredConfig) -> int:
    """What the cloud side does: the gateway's return-path topic, with the kind header."""
    return send_raw(iggy, settings, msg.wire(), headers=msg.headers())


def send_raw(
    iggy: MemoryIggy,
    settings: Settings,
    payload: bytes,
    *,
    config: bool = False,
    headers: dict[str, str] | None = None,
) -> int:
    """`payload` to the gateway's return-path topic; the kind header says
    command (or config), unless `headers` are given."""
    rt = return_topic(settings)
    provision(iggy, settings)
    if headers is None:
        headers = {KIND_HEADER: KIND_CONFIG if config else KIND_COMMAND}
    return iggy.publish(rt.stream, rt.topic, rt.partition, payload, headers)


class Running:
    def __init__(self, settings: Settings, iggy: MemoryIggy) -> None:
        provision(iggy, settings)
        self.agent = build_agent(
            settings, uplink=iggy.uplink(), command_source=iggy.command_source(consumer_name(settings))
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Running:
        self.task = asyncio.create_task(self.agent.run(), name="agent-under-test")
        await asyncio.wait_for(self.agent.ready.wait(), 10)
        return self

    def metric(self, name: str, **labels: str) -> float:
        return self.agent.metrics.value(name, **labels)

    async def stop(self) -> None:
        assert self.task is not None
        self.agent.stop()
        await asyncio.wait_for(self.task, 15)

    async def hard_kill(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@contextlib.asynccontextmanager
async def running(settings: Settings, iggy: MemoryIggy) -> AsyncIterator[Running]:
    r = await Running(settings, iggy).start()
    try:
        yield r
    finally:
        assert r.task is not None
        if not r.task.done():
            await r.stop()


@contextlib.asynccontextmanager
async def device(broker: Broker, topic_filter: str = "edge/+/down/#") -> AsyncIterator[DeviceSubscriber]:
    dev = await DeviceSubscriber(broker.host, broker.port, topic_filter).start()
    try:
        yield dev
    finally:
        await dev.stop()


MARKER = json.dumps({"marker": True}).encode()


def before_marker(messages: list[Received]) -> list[Received]:
    """The messages a subscriber got before the MARKER (published later by
    another client: what the broker sent before it, it sent first)."""
    return list(itertools.takewhile(lambda m: m.payload != MARKER, messages))


async def publish(broker: Broker, topic: str, payload: bytes) -> None:
    client = gmqtt.Client("test-device-ack", clean_session=True)
    await client.connect(broker.host, broker.port, version=MQTTv50)
    client.publish(topic, payload, qos=1)
    await client.disconnect()


def stored_offset(
    settings: Settings, topic: str | None = None, partition: int = 0, stream: str = ""
) -> int | None:
    """The inbox's last consumed offset of a partition (default: the return-path topic's)."""
    if topic is None:
        rt = return_topic(settings)
        stream, topic, partition = rt.stream, rt.topic, rt.partition
    for s, t, p, last, _ in read_offsets(settings.buffer_path):
        if (s, t, p) == (stream or s, topic, partition):
            return last
    return None


@dataclass
class PollHarness:
    """The real return poll on a real SQLite file: MemoryIggy as the command
    source, the real inbox, and the real outbox as its dead-letter sink."""

    settings: Settings
    iggy: MemoryIggy
    inbox: Inbox
    outbox: Outbox
    poll: ReturnPoll
    metrics: Metrics
    task: asyncio.Task[None]

    def send_raw(self, payload: bytes, *, config: bool = False, headers: dict[str, str] | None = None) -> int:
        return send_raw(self.iggy, self.settings, payload, config=config, headers=headers)

    def offset(self) -> int | None:
        return stored_offset(self.settings)


@contextlib.asynccontextmanager
async def poll_harness(settings: Settings) -> AsyncIterator[PollHarness]:
    metrics = Metrics()
    outbox = await Outbox.open(settings.buffer_path, settings.buffer, settings.gateway_id, metrics)
    inbox = await Inbox.open(settings.buffer_path, settings)
    iggy = MemoryIggy(partitions=settings.iggy.partitions)
    provision(iggy, settings)
    poll = ReturnPoll(settings, iggy.command_source(consumer_name(settings)), inbox, outbox, metrics)
    task = asyncio.create_task(poll.run(), name="return-poll-under-test")
    try:
        yield PollHarness(settings, iggy, inbox, outbox, poll, metrics, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await inbox.close()
        await outbox.close()
