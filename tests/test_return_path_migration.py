"""Migration from the two-topic scheme (issue 23): a gateway upgraded from
``commands.<gw>`` / ``config.<gw>`` (3 partitions each, offsets in its
SQLite) keeps the commands and configs pending there -- those beyond its
stored offsets are delivered, before anything newer from the return-path
topic -- and afterwards never polls the old topics again.  The real return
poll on a real SQLite file with MemoryIggy, then the whole agent against a
real iggy-server with the gateway's provisioned (least-privileged) user."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from iggy_edge.config import Settings
from iggy_edge.downlink.commands import Command, DesiredConfig, legacy_topics, make_command, make_config
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.legacy import DRAINED_NOTE
from iggy_edge.downlink.poll import ReturnPoll
from iggy_edge.inbox_admin import read_commands, read_configs
from iggy_edge.metrics import Metrics
from iggy_edge.runtime import build_agent
from iggy_edge.store.outbox import Outbox
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.iggy import IggyCommandSink
from iggy_edge.uplink.iggy.connection import Connection
from iggy_edge.uplink.iggy.topics import create_topic
from iggy_edge.uplink.memory import MemoryCommandSource, MemoryIggy
from iggy_edge.uplink.partition import partition_for
from iggy_edge.uplink.protocol import PolledMessage, UplinkRejected

from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.provisioning import gateway_settings, provision
from tests.support.return_path import send
from tests.support.wait import async_wait_until

OLD_PARTITIONS = 3


class Source(MemoryCommandSource):
    """MemoryIggy's source, counting polls per topic; can refuse a topic."""

    def __init__(self, iggy: MemoryIggy, consumer: str, refuse: str = "") -> None:
        super().__init__(iggy, consumer)
        self.by_topic: dict[str, int] = {}
        self.refuse = refuse

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        self.by_topic[topic] = self.by_topic.get(topic, 0) + 1
        if topic == self.refuse:
            raise UplinkRejected("iggy: Unauthorized")
        return await super().poll(stream, topic, partition_id, offset, count)

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        if topic == self.refuse:
            raise UplinkRejected("iggy: Unauthorized")
        return await super().last_offsets(stream, topic)


def old_send(iggy: MemoryIggy, settings: Settings, msg: Command | DesiredConfig) -> int:
    """What the cloud side did before: commands.<gw> or config.<gw>, the device's partition."""
    commands, config = legacy_topics(settings.gateway_id, settings.downlink)
    topic = commands if isinstance(msg, Command) else config
    iggy.create_topic("edge", topic, OLD_PARTITIONS)
    return iggy.publish("edge", topic, partition_for(msg.device, OLD_PARTITIONS), msg.wire())


async def consumed_before_the_upgrade(settings: Settings, msg: Command, offset: int) -> None:
    """The old agent's state: it had consumed `msg`'s partition up to
    `offset` (and delivered what it read; its rows are long pruned)."""
    commands, _ = legacy_topics(settings.gateway_id, settings.downlink)
    inbox = await Inbox.open(settings.buffer_path, settings)
    await inbox.store_polled("edge", commands, partition_for(msg.device, OLD_PARTITIONS), offset)
    await inbox.close()


@contextlib.asynccontextmanager
async def polling(settings: Settings, source: Source) -> AsyncIterator[None]:
    metrics = Metrics()
    outbox = await Outbox.open(settings.buffer_path, settings.buffer, settings.gateway_id, metrics)
    inbox = await Inbox.open(settings.buffer_path, settings)
    poll = ReturnPoll(settings, source, inbox, outbox, metrics)
    task = asyncio.create_task(poll.run(), name="return-poll-under-test")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await inbox.close()
        await outbox.close()


def ids(settings: Settings) -> list[str]:
    """Command ids in arrival (= delivery) order."""
    return [r.id for r in reversed(read_commands(settings.buffer_path, limit=1000))]


async def drained(settings: Settings) -> str | None:
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:
        return await inbox.note(DRAINED_NOTE)
    finally:
        await inbox.close()


async def test_pending_old_commands_and_configs_come_first_then_the_old_topics_are_left(
    tmp_path: Path,
) -> None:
    settings = downlink_settings(tmp_path, iggy={"partitions": OLD_PARTITIONS})
    iggy = MemoryIggy(partitions=OLD_PARTITIONS)
    a = [make_command("dev-a", "step", {"i": i}, command_id=f"a{i}") for i in range(6)]
    b0 = make_command("dev-b", "step", command_id="b0")
    for c in (a[0], a[1], a[2], b0):
        old_send(iggy, settings, c)
    old_send(iggy, settings, make_config("dev-a", {"v": 1}, config_id="v1"))
    await consumed_before_the_upgrade(settings, a[0], 0)  # a0 was read (and delivered) before
    send(iggy, settings, a[3])  # the cloud side writes the new topic from the upgrade on
    send(iggy, settings, make_config("dev-a", {"v": 2}, config_id="v2"))
    source = Source(iggy, consumer_name(settings))
    commands, config = legacy_topics(settings.gateway_id, settings.downlink)
    async with polling(settings, source):
        await async_wait_until(lambda: "a3" in ids(settings), what="the new command")
        got = ids(settings)
        assert sorted(got) == ["a1", "a2", "a3", "b0"]  # a0 was consumed before: not read again
        assert got.index("a1") < got.index("a2") < got.index("a3")  # per device: old ones first
        assert {r[0]: r[1] for r in read_configs(settings.buffer_path)} == {"dev-a": "v2"}
        assert await drained(settings) is not None
        old_polls = source.by_topic[commands] + source.by_topic[config]
        # after the migration: a message in an old topic is not read, a new one is
        old_send(iggy, settings, a[4])
        send(iggy, settings, a[5])
        await async_wait_until(lambda: "a5" in ids(settings), what="the next new command")
        assert "a4" not in ids(settings)
        assert source.by_topic[commands] + source.by_topic[config] == old_polls
    again = Source(iggy, consumer_name(settings))
    async with polling(settings, again):  # a restart: the note holds
        send(iggy, settings, make_command("dev-a", "after-restart", command_id="a6"))
        await async_wait_until(lambda: "a6" in ids(settings), what="a command after the restart")
    assert "a4" not in ids(settings)
    assert set(again.by_topic) == {f"return.{settings.gateway_id}"}


async def test_an_old_topic_the_server_refuses_is_retried_at_the_next_start(tmp_path: Path) -> None:
    """The new user may not read the old topics (made by hand, not by
    provision-gateway): the new topic is polled anyway, nothing is noted,
    and the next start reads the old topics out once it may."""
    settings = downlink_settings(tmp_path, iggy={"partitions": OLD_PARTITIONS})
    iggy = MemoryIggy(partitions=OLD_PARTITIONS)
    commands, _ = legacy_topics(settings.gateway_id, settings.downlink)
    old_send(iggy, settings, make_command("dev-a", "old", command_id="old"))
    send(iggy, settings, make_command("dev-a", "new", command_id="new"))
    async with polling(settings, Source(iggy, consumer_name(settings), refuse=commands)):
        await async_wait_until(lambda: "new" in ids(settings), what="the new topic polled anyway")
        await asyncio.sleep(0.3)
        assert ids(settings) == ["new"]
    assert await drained(settings) is None
    async with polling(settings, Source(iggy, consumer_name(settings))):
        await async_wait_until(lambda: "old" in ids(settings), what="read out at the next start")
        for _ in range(200):  # noted by the round after, which finds the old partitions empty
            if await drained(settings) is not None:
                break
            await asyncio.sleep(0.05)
    assert await drained(settings) is not None


async def test_no_old_topics_means_nothing_to_migrate(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    iggy = MemoryIggy()
    send(iggy, settings, make_command("dev-a", "x", command_id="x"))
    source = Source(iggy, consumer_name(settings))
    async with polling(settings, source):
        await async_wait_until(lambda: ids(settings) == ["x"], what="the command")
    assert await drained(settings) is not None
    assert set(source.by_topic) == {f"return.{settings.gateway_id}"}


@pytest.mark.iggy
async def test_a_real_upgraded_gateway_delivers_what_was_pending_in_the_old_topics(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """Old topics as the old agent created them (3 partitions each, persisted)
    and filled by the old cloud side; the gateway had consumed dev-a's first
    command.  After provision-gateway (which grants the read of the old
    topics) the upgraded agent, logged in as the gateway's user, delivers
    the pending ones, then the new one, each once, in per-device order."""
    admin = downlink_settings(
        tmp_path,
        broker,
        iggy={
            "kind": "iggy",
            "address": iggy_server.address,
            "username": iggy_server.username,
            "password": iggy_server.password,
            "partitions": OLD_PARTITIONS,
        },
        downlink={"poll_interval_s": 0.1},
    )
    commands, config = legacy_topics(admin.gateway_id, admin.downlink)
    conn = Connection(admin.iggy, "old cloud side")
    client = await conn.client()
    for topic in (commands, config):
        await create_topic(conn, client, "edge", topic, OLD_PARTITIONS)
    await conn.close()
    sink = IggyCommandSink(admin.iggy)
    a = [make_command("dev-a", "step", {"i": i}, command_id=f"a{i}") for i in range(4)]
    b0 = make_command("dev-b", "step", command_id="b0")
    try:
        offsets = {}
        for c in (a[0], a[1], a[2], b0):  # no kind header: the old scheme had none
            offsets[c.id] = await sink.publish(
                "edge", commands, partition_for(c.device, OLD_PARTITIONS), c.wire()
            )
        cfg = make_config("dev-a", {"period_s": 7}, config_id="v1")
        await sink.publish("edge", config, partition_for("dev-a", OLD_PARTITIONS), cfg.wire())
        assert offsets["a0"] == 0
        await consumed_before_the_upgrade(admin, a[0], 0)
        provisioned = await provision(admin)
        assert provisioned.legacy_topics == [f"edge/{commands}", f"edge/{config}"]
        rt_stream, rt_topic = provisioned.return_stream, provisioned.return_topic
        await sink.publish(rt_stream, rt_topic, 0, a[3].wire(), a[3].headers())
    finally:
        await sink.close()
    settings = gateway_settings(admin, provisioned)
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    try:
        await async_wait_until(lambda: "a3" in dev.ids(), timeout=30, what="the new command")
        got = dev.ids()
        assert sorted(got) == ["a1", "a2", "a3", "b0"]  # a0 was consumed before: not again
        assert got.index("a1") < got.index("a2") < got.index("a3")
        await async_wait_until(
            lambda: any(m.topic == "edge/dev-a/down/config" for m in dev.messages), what="the old config"
        )
        assert agent.metrics.value("iggy_edge_downlink_errors_total", kind="poll") == 0
        assert await drained(settings) is not None
    finally:
        await dev.stop()
        agent.stop()
        await asyncio.wait_for(task, 20)
