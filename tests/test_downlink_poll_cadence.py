"""The return poll looks before it polls (issue 14, command latency).

Between full rounds it asks the source for every partition's newest offset
(`last_offsets`, one GET_TOPIC on a real server) and polls only partitions
past what it has read; a server that refuses the look gets every partition
polled, as before.  Real Mosquitto, MemoryIggy behind a recording wrapper, and
`IggyCommandSource.last_offsets` against a real iggy-server when on PATH.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from iggy_edge.config import Settings
from iggy_edge.downlink import poll
from iggy_edge.downlink.commands import commands_topic, config_topic, make_command, partition_of
from iggy_edge.runtime import build_agent
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.iggy import IggyCommandSink, IggyCommandSource
from iggy_edge.uplink.memory import MemoryCommandSource, MemoryIggy
from iggy_edge.uplink.protocol import PolledMessage, UplinkRejected

from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.wait import async_wait_until


class Recording:
    """A MemoryCommandSource that records each poll's (topic, partition) and
    can refuse looks like a server whose user may not read topic details.
    The board updater's topic (``ota.<gw>``, ota/cloud.py) shares the source
    and is passed through unrecorded: its cadence is its own."""

    def __init__(self, inner: MemoryCommandSource, *, refuse_looks: bool = False) -> None:
        self.inner = inner
        self.refuse_looks = refuse_looks
        self.polled: list[tuple[str, int]] = []
        self.looks = 0

    async def start(self) -> None:
        await self.inner.start()

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        if not topic.startswith("ota."):
            self.polled.append((topic, partition_id))
        return await self.inner.poll(stream, topic, partition_id, offset, count)

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        if topic.startswith("ota."):
            return await self.inner.last_offsets(stream, topic)
        self.looks += 1
        if self.refuse_looks:
            raise UplinkRejected("iggy: Unauthorized (permission denied)")
        return await self.inner.last_offsets(stream, topic)

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        await self.inner.mirror_offset(stream, topic, partition_id, offset)

    async def close(self) -> None:
        await self.inner.close()


async def _deliver_one(settings: Settings, iggy: MemoryIggy, source: Recording, broker: Broker) -> int:
    """Start the agent, wait for its first (full) round, send one command to
    dev-1 and wait until the device has it; the number of polls of the first
    round."""
    agent = build_agent(settings, uplink=iggy.uplink(), command_source=source)
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        # the start-up check polls one past the last partition of each topic,
        # then the first round polls every partition
        first_round = 2 * (settings.iggy.partitions + 1)
        await async_wait_until(lambda: len(source.polled) >= first_round, what="first round")
        before = len(source.polled)
        cmd = make_command("dev-1", "relay", {"on": True})
        iggy.publish("edge", commands_topic(settings), partition_of("dev-1", settings), cmd.wire())
        await async_wait_until(lambda: dev.ids() == [cmd.id], what="device got the command")
        return before
    finally:
        await dev.stop()
        agent.stop()
        await asyncio.wait_for(task, 15)


async def test_between_full_rounds_only_partitions_with_new_messages_are_polled(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(poll, "FULL_ROUND_EVERY", 10**6)  # only the first round is full
    settings = downlink_settings(tmp_path, broker, downlink={"poll_interval_s": 0.25})
    iggy = MemoryIggy(partitions=3)
    source = Recording(iggy.command_source(consumer_name(settings)))
    first = await _deliver_one(settings, iggy, source, broker)
    cmds, cfg = commands_topic(settings), config_topic(settings)
    assert sorted(source.polled[:first]) == sorted((t, p) for t in (cmds, cfg) for p in range(4))
    # afterwards: looks, and a poll of dev-1's partition alone
    assert set(source.polled[first:]) == {(cmds, partition_of("dev-1", settings))}
    assert source.looks > 0


async def test_a_refused_look_falls_back_to_polling_every_partition(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker, downlink={"poll_interval_s": 0.1})
    iggy = MemoryIggy(partitions=3)
    source = Recording(iggy.command_source(consumer_name(settings)), refuse_looks=True)
    await _deliver_one(settings, iggy, source, broker)
    assert source.looks == 1  # refused once, not asked again
    polled = source.polled[2:]  # after the start-up check of the partition count
    rounds = len(polled) // 6
    assert rounds >= 2
    every = sorted((t, p) for t in (commands_topic(settings), config_topic(settings)) for p in range(3))
    for r in range(rounds):
        assert sorted(polled[r * 6 : (r + 1) * 6]) == every


@pytest.mark.iggy
async def test_real_server_last_offsets(tmp_path: Path, iggy_server: IggyServer) -> None:
    settings = downlink_settings(
        tmp_path,
        iggy={
            "kind": "iggy",
            "address": iggy_server.address,
            "username": iggy_server.username,
            "password": iggy_server.password,
            "partitions": 3,
        },
    )
    source = IggyCommandSource(settings.iggy, settings.gateway_id, consumer_name(settings))
    sink = IggyCommandSink(settings.iggy)
    await source.start()
    await sink.start()
    try:
        assert await source.last_offsets("edge", "no-such-topic") is None
        for _ in range(3):
            await sink.publish("edge", "cadence", 1, b"{}")
        await sink.publish("edge", "cadence", 2, b"{}")
        assert await source.last_offsets("edge", "cadence") == {0: -1, 1: 2, 2: 0}
    finally:
        await sink.close()
        await source.close()
