"""The return poll's cadence (issue 23): one partition, polled once per
poll_interval_s while quiet (one request per second at the default), 20
times per interval for 3 intervals after a message came in.  The agent
never creates its return-path topic.  Real Mosquitto, MemoryIggy behind a
recording wrapper, and `IggyCommandSource.last_offsets` against a real
iggy-server when on PATH.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from iggy_edge.config import Settings
from iggy_edge.downlink import poll
from iggy_edge.downlink.commands import make_command, return_topic
from iggy_edge.runtime import build_agent, updates
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.iggy import IggyCommandSink, IggyCommandSource
from iggy_edge.uplink.memory import MemoryCommandSource, MemoryIggy
from iggy_edge.uplink.protocol import PolledMessage, UplinkRejected

from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.return_path import provision, send
from tests.support.wait import async_wait_until


class Recording:
    """A MemoryCommandSource that records each poll's (topic, partition) and
    every request's topic (`topics`), and can refuse looks like a server whose
    user may not read topic details.  Board updates ride the return-path topic
    (ota/cloud.py): nothing here is left out."""

    def __init__(self, inner: MemoryCommandSource, *, refuse_looks: bool = False) -> None:
        self.inner = inner
        self.refuse_looks = refuse_looks
        self.polled: list[tuple[str, int]] = []
        self.times: list[float] = []
        self.marks: dict[str, float] = {}
        self.looks = 0
        self.topics: list[str] = []  # every poll, look and mirror, in order

    @property
    def first(self) -> float:
        return self.times[0]

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic()

    def count_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.times if start <= t < end)

    async def start(self) -> None:
        await self.inner.start()

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        self.polled.append((topic, partition_id))
        self.times.append(time.monotonic())
        self.topics.append(topic)
        return await self.inner.poll(stream, topic, partition_id, offset, count)

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        self.looks += 1
        self.topics.append(topic)
        if self.refuse_looks:
            raise UplinkRejected("iggy: Unauthorized (permission denied)")
        return await self.inner.last_offsets(stream, topic)

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        self.topics.append(topic)
        await self.inner.mirror_offset(stream, topic, partition_id, offset)

    async def close(self) -> None:
        await self.inner.close()


async def _deliver_one(settings: Settings, iggy: MemoryIggy, source: Recording, broker: Broker) -> None:
    """Start the agent, wait for its first poll, let it idle `IDLE_S`, send
    one command to dev-1 and wait until the device has it."""
    agent = build_agent(settings, uplink=iggy.uplink(), command_source=source)
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        await async_wait_until(lambda: source.polled, what="first poll")
        await asyncio.sleep(IDLE_S)
        source.mark("command")
        cmd = make_command("dev-1", "relay", {"on": True})
        send(iggy, settings, cmd)
        await async_wait_until(lambda: dev.ids() == [cmd.id], what="device got the command")
        await asyncio.sleep(IDLE_S)
    finally:
        await dev.stop()
        agent.stop()
        await asyncio.wait_for(task, 15)


IDLE_S = 2.0


async def test_quiet_it_polls_the_one_partition_once_per_interval_and_faster_after_a_command(
    tmp_path: Path, broker: Broker
) -> None:
    """One look at start (the topic is there, one partition), then only polls
    of partition 0 of the return-path topic: one per poll_interval_s while
    quiet, HOT_POLLS_PER_INTERVAL per interval for HOT_INTERVALS intervals
    after the command, then quiet again."""
    interval = 0.25
    settings = downlink_settings(tmp_path, broker, downlink={"poll_interval_s": interval})
    iggy = MemoryIggy(partitions=3)
    provision(iggy, settings)
    source = Recording(iggy.command_source(consumer_name(settings)))
    await _deliver_one(settings, iggy, source, broker)
    rt = return_topic(settings)
    assert set(source.polled) == {(rt.topic, 0)}
    assert source.looks == 3  # at start: the topic, and the two of the old scheme (none: nothing to read out)
    quiet = source.count_between(source.first + 0.1, source.marks["command"])
    # IDLE_S of quiet at one poll per interval (8), less what the first poll's wait takes
    assert 4 <= quiet <= IDLE_S / interval + 2, quiet
    hot_s = poll.HOT_INTERVALS * interval
    hot = source.count_between(source.marks["command"] + 0.1, source.marks["command"] + hot_s - 0.1)
    assert hot >= 0.5 * (hot_s - 0.2) / (interval / poll.HOT_POLLS_PER_INTERVAL), hot
    after = source.count_between(source.marks["command"] + hot_s + 0.5, source.marks["command"] + IDLE_S)
    assert after <= (IDLE_S - hot_s - 0.5) / interval + 2, after


async def test_a_quiet_gateway_with_board_updates_on_makes_one_poll_per_second_and_nothing_else(
    tmp_path: Path, broker: Broker
) -> None:
    """The whole agent (build_agent: the updater runs), default cadence, no
    traffic: after the looks at start, one poll of the return-path topic per
    second and no other request -- board updates from the cloud side ride
    that poll (kind = ota) and cost nothing of their own."""
    settings = downlink_settings(tmp_path, broker, downlink={"poll_interval_s": 1.0})
    iggy = MemoryIggy(partitions=3)
    provision(iggy, settings)
    source = Recording(iggy.command_source(consumer_name(settings)))
    agent = build_agent(settings, uplink=iggy.uplink(), command_source=source)
    assert updates in agent.components
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        await async_wait_until(lambda: source.polled, what="first poll")
        looks = len(source.topics) - 1
        await asyncio.sleep(QUIET_S)
    finally:
        agent.stop()
        await asyncio.wait_for(task, 15)
    rt = return_topic(settings)
    assert looks == source.looks == 3  # at start: the topic and the two of the old scheme
    after_start = source.topics[looks:]
    assert set(after_start) == {rt.topic}, after_start
    assert len(after_start) == len(source.polled)  # polls only: no look, no mirror
    quiet = source.count_between(source.first, source.first + QUIET_S - 0.5)
    assert QUIET_S - 2 <= quiet <= QUIET_S, quiet  # one per second (the window holds 3.5 s)


QUIET_S = 4.0


async def test_a_refused_look_does_not_stop_polling(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker, downlink={"poll_interval_s": 0.1})
    iggy = MemoryIggy(partitions=3)
    provision(iggy, settings)
    source = Recording(iggy.command_source(consumer_name(settings)), refuse_looks=True)
    await _deliver_one(settings, iggy, source, broker)
    assert source.looks == 2  # the topic's, refused at start (then the old ones': refused, skipped)


async def test_a_missing_return_topic_is_an_error_until_it_is_provisioned(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent never creates its topic: it says what to run, retries, and
    picks the topic up once the cloud side made it."""
    settings = downlink_settings(tmp_path, broker, downlink={"poll_interval_s": 0.05})
    iggy = MemoryIggy(partitions=3, create_missing=False)
    source = Recording(iggy.command_source(consumer_name(settings)))
    agent = build_agent(settings, uplink=iggy.uplink(), command_source=source)
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        await async_wait_until(lambda: source.looks >= 2, what="the start retried")
        assert not source.polled
        assert "iggy-edge cloud provision-gateway --gateway gw-test" in caplog.text
        assert (return_topic(settings).stream, return_topic(settings).topic) not in iggy.topics
        provision(iggy, settings)
        cmd = make_command("dev-1", "relay", {"on": True})
        send(iggy, settings, cmd)
        await async_wait_until(lambda: dev.ids() == [cmd.id], timeout=40, what="delivered once provisioned")
    finally:
        await dev.stop()
        agent.stop()
        await asyncio.wait_for(task, 15)


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
