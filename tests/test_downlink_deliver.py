"""Deliver against a real Mosquitto: PUBACK tracking, refusals, expiry,
retained config, broker outage with ordered delivery afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import gmqtt
import pytest
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge.config import Settings
from iggy_edge.downlink.commands import Ack, Command, CommandState, DesiredConfig, make_command, make_config
from iggy_edge.downlink.deliver import Deliverer
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.inflight import POISON_STRIKES
from iggy_edge.inbox_admin import read_commands
from iggy_edge.metrics import Metrics

from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, Received, downlink_settings
from tests.support.wait import async_wait_until


def states(settings: Settings) -> dict[str, str]:
    return {r.id: r.state for r in read_commands(settings.buffer_path, limit=1000)}


@contextlib.asynccontextmanager
async def deliverer(settings: Settings) -> AsyncIterator[tuple[Deliverer, Inbox, Metrics]]:
    inbox = await Inbox.open(settings.buffer_path, settings)
    metrics = Metrics()
    d = Deliverer(settings, inbox, metrics)
    task = asyncio.create_task(d.run())
    try:
        yield d, inbox, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await inbox.close()


async def put(inbox: Inbox, *items: object, offset: int = 0, now: float | None = None) -> None:
    """Store items as one poll would (`now`: the time the poll happened)."""
    cmds = [(c, f"t/0@{offset + i}") for i, c in enumerate(items) if not hasattr(c, "config")]
    cfgs = [(c, f"c/0@{offset + i}") for i, c in enumerate(items) if hasattr(c, "config")]
    last = offset + len(items) - 1
    await inbox.store_polled("edge", "commands.gw-test", 0, last, cmds, cfgs, now=now)  # type: ignore[arg-type]


async def publish_marker(broker: Broker, topic: str) -> None:
    """A non-retained message from another client: a subscriber that gets it
    has already got everything the broker sent it before (one connection,
    in order), so "nothing else arrived" can be checked without sleeping."""
    client = gmqtt.Client(f"marker-{uuid.uuid4().hex[:8]}", clean_session=True)
    await client.connect(broker.host, broker.port, version=MQTTv50)
    client.publish(topic, json.dumps({"marker": True}).encode(), qos=1)
    await client.disconnect()


def before_marker(messages: list[Received]) -> list[Received]:
    return list(itertools.takewhile(lambda m: m.doc != {"marker": True}, messages))


async def test_command_is_marked_delivered_only_after_the_brokers_puback(
    tmp_path: Path, broker: Broker
) -> None:
    settings = downlink_settings(tmp_path, broker)
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/dev-1/down/#").start()
    try:
        async with deliverer(settings) as (d, inbox, metrics):
            cmds = [make_command("dev-1", "blink", {"n": i}) for i in range(5)]
            await put(inbox, *cmds)
            d.wake()
            await async_wait_until(lambda: len(dev.messages) == 5, what="device got 5 commands")
            await async_wait_until(
                lambda: set(states(settings).values()) == {"delivered"}, what="all marked delivered"
            )
            assert dev.ids() == [c.id for c in cmds]  # in order
            first = dev.messages[0]
            assert first.topic == "edge/dev-1/down/cmd"
            assert not first.retain
            assert first.doc == {
                "id": cmds[0].id,
                "name": "blink",
                "args": {"n": 0},
                # whole seconds: a float is float32 on the board
                "created_at": int(cmds[0].created_at),
                "expires_at": int(cmds[0].expires_at),
            }
            assert metrics.value("iggy_edge_downlink_commands_total", state="delivered") == 5
            assert metrics.value("iggy_edge_downlink_inbox_records") == 0
    finally:
        await dev.stop()


async def test_broker_refusal_marks_the_command_failed(tmp_path: Path) -> None:
    # An ACL that forbids writing to dev-locked's topics: Mosquitto answers the
    # MQTT 5 PUBLISH with PUBACK reason 0x87 (not authorized).
    acl = tmp_path / "acl"
    acl.write_text("pattern write edge/dev-ok/#\npattern read #\n")
    broker = Broker(tmp_path / "broker", extra_conf=f"acl_file {acl}\n").start()
    try:
        settings = downlink_settings(tmp_path, broker)
        async with deliverer(settings) as (d, inbox, metrics):
            bad, good = make_command("dev-locked", "open"), make_command("dev-ok", "open")
            await put(inbox, bad, good)
            d.wake()
            await async_wait_until(
                lambda: sorted(states(settings).values()) == ["delivered", "failed"], what="both finished"
            )
            rows = {r.id: r for r in read_commands(settings.buffer_path)}
            assert rows[bad.id].state == "failed"
            assert "0x87" in rows[bad.id].detail
            assert rows[good.id].state == "delivered"
            assert metrics.value("iggy_edge_downlink_commands_total", state="failed") == 1
    finally:
        broker.stop()


async def test_expired_commands_are_not_delivered(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/cmd").start()
    try:
        async with deliverer(settings) as (d, inbox, _):
            # Created 10 s ago with 5 s to live: past its expiry before delivery.
            stale = make_command("dev-1", "old", ttl_s=5, now=time.time() - 10)
            fresh = make_command("dev-1", "new", ttl_s=60)
            await put(inbox, stale, fresh)
            d.wake()
            await async_wait_until(
                lambda: states(settings).get(fresh.id) == "delivered", what="fresh delivered"
            )
            assert states(settings)[stale.id] == "expired"
            # Delivery is in inbox order over one connection: a stale copy
            # sent by mistake would reach the device before `fresh`.
            await async_wait_until(lambda: fresh.id in dev.ids(), what="device got fresh")
            assert dev.ids() == [fresh.id]
    finally:
        await dev.stop()


async def test_commands_expire_while_the_broker_is_down(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    broker.stop()
    async with deliverer(settings) as (d, inbox, metrics):
        # Polled 10 s ago with 5 s to live: arrived valid, and its expiry
        # passed while no broker was reachable.
        polled_at = time.time() - 10
        cmd = make_command("dev-1", "x", ttl_s=5, now=polled_at)
        await put(inbox, cmd, now=polled_at)
        assert states(settings)[cmd.id] == "received"
        await async_wait_until(lambda: states(settings)[cmd.id] == "expired", what="expired without broker")
        assert metrics.value("iggy_edge_downlink_commands_total", state="expired") == 1
        assert not d.connected.is_set()


async def test_retained_config_late_subscriber_gets_only_the_newest(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    async with deliverer(settings) as (d, inbox, _):
        await put(inbox, make_config("dev-1", {"period_s": 10}), offset=0)
        d.wake()
        await async_wait_until(lambda: _config_state(settings) == "delivered", what="config 1 retained")
        await put(inbox, make_config("dev-1", {"period_s": 20}), offset=1)
        d.wake()
        await async_wait_until(lambda: _config_state(settings) == "delivered", what="config 2 retained")
        # Two configs in one poll: only the newest is kept and published.
        await put(
            inbox, make_config("dev-1", {"period_s": 30}), make_config("dev-1", {"period_s": 40}), offset=2
        )
        d.wake()
        await async_wait_until(lambda: _config_state(settings) == "delivered", what="config 4 retained")
    late = await DeviceSubscriber(broker.host, broker.port, "edge/dev-1/down/config").start()
    try:
        # Retained messages come right after the SUBACK, before anything
        # published later: everything before the marker is what was retained.
        await publish_marker(broker, "edge/dev-1/down/config")
        await async_wait_until(lambda: len(before_marker(late.messages)) < len(late.messages), what="marker")
        assert [(m.doc, m.retain) for m in before_marker(late.messages)] == [({"period_s": 40}, True)]
    finally:
        await late.stop()


def _config_state(settings: Settings, device: str = "dev-1") -> str:
    with contextlib.closing(sqlite3.connect(settings.buffer_path)) as c:
        row = c.execute("SELECT state FROM downlink_config WHERE device = ?", (device,)).fetchone()
    return "" if row is None else str(row[0])


async def test_broker_outage_commands_wait_and_go_out_in_order(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    async with deliverer(settings) as (d, inbox, _):
        await async_wait_until(d.connected.is_set, what="deliver connected")
        broker.stop()
        await async_wait_until(lambda: not d.connected.is_set(), what="deliver noticed the outage")
        cmds = [make_command(f"dev-{i % 2}", "step", {"i": i}) for i in range(20)]
        # A marker polled 10 s ago with 5 s to live: the deliverer expires it
        # on its next pass, so once it is expired the deliverer has had its
        # chance at the other 20 while the broker was away.
        polled_at = time.time() - 10
        marker = make_command("dev-0", "marker", ttl_s=5, now=polled_at)
        await put(inbox, *cmds, marker, now=polled_at)
        d.wake()
        await async_wait_until(lambda: states(settings)[marker.id] == "expired", what="a deliverer pass")
        assert {states(settings)[c.id] for c in cmds} == {"received"}  # nothing delivered, nothing lost
        broker.start()  # same port, persistence kept
        dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/cmd").start()
        try:
            await async_wait_until(
                lambda: all(states(settings)[c.id] == "delivered" for c in cmds),
                timeout=15,
                what="delivered after the outage",
            )
            await async_wait_until(lambda: len(dev.messages) == 20, what="device got all 20")
            for device in ("dev-0", "dev-1"):
                got = [m.doc["args"]["i"] for m in dev.messages if m.topic == f"edge/{device}/down/cmd"]
                assert got == sorted(got)
            assert dev.ids() == [c.id for c in cmds]
        finally:
            await dev.stop()


@pytest.mark.parametrize("state", [CommandState.ACKED])
async def test_ack_before_puback_is_not_overwritten(tmp_path: Path, state: CommandState) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:
        cmd = make_command("dev-1", "x")
        await put(inbox, cmd)
        assert (await inbox.apply_acks([("dev-1", Ack(cmd.id, "ok", None))])).done == [(cmd.id, state)]
        # The PUBACK is processed after the device's ack: no regression to delivered.
        assert await inbox.finish([(cmd.id, CommandState.DELIVERED, "")]) == []
        assert states(settings)[cmd.id] == "acked"
        assert await inbox.due_commands(10) == []
    finally:
        await inbox.close()


async def test_a_publish_that_drops_the_connection_is_failed_and_the_queue_goes_on(tmp_path: Path) -> None:
    # Mosquitto drops a client whose packet is over its max_packet_size: a
    # command the parser accepts (2 KB, under what devices take) that this
    # broker cannot take.  It is the oldest, so it is re-sent first.
    broker = Broker(tmp_path / "broker", extra_conf="max_packet_size 1500\n").start()
    settings = downlink_settings(tmp_path, broker, mqtt={"reconnect_min_s": 0.2, "reconnect_max_s": 0.5})
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/cmd").start()
    try:
        async with deliverer(settings) as (d, inbox, metrics):
            poison = make_command("dev-1", "big", {"blob": "x" * 2000})
            healthy = [make_command(f"dev-{i}", "small", {"i": i}) for i in range(3)]
            await put(inbox, poison, *healthy)
            started = time.monotonic()
            d.wake()
            await async_wait_until(
                lambda: all(states(settings)[c.id] == "delivered" for c in healthy),
                timeout=30,
                what="the commands behind the poison are delivered",
            )
            waited = time.monotonic() - started
            assert states(settings)[poison.id] == "failed"
            row = next(r for r in read_commands(settings.buffer_path) if r.id == poison.id)
            assert "dropped the connection" in row.detail
            await async_wait_until(lambda: len(dev.ids()) == 3, what="the device got the healthy ones")
            assert sorted(dev.ids()) == sorted(c.id for c in healthy)
            assert metrics.value("iggy_edge_downlink_commands_total", state="failed") == 1
            assert metrics.value("iggy_edge_downlink_errors_total", kind="publish_dropped") == POISON_STRIKES
            print(f"healthy commands behind the poison waited {waited:.2f}s")
    finally:
        await dev.stop()
        broker.stop()


async def test_an_inbox_row_that_is_not_a_device_id_is_failed_without_publishing(
    tmp_path: Path, broker: Broker
) -> None:
    # Written into the inbox past the parser (the inbox is our boundary): a
    # NUL in the topic makes Mosquitto drop the connection.
    settings = downlink_settings(tmp_path, broker)
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    try:
        async with deliverer(settings) as (d, inbox, metrics):
            poison = Command("p1", "dev\x00x", "n", {}, time.time(), time.time() + 3600)
            bad_cfg = DesiredConfig("c1", "dev\x1bx", {"a": 1}, time.time())
            healthy = make_command("dev-1", "after")
            await put(inbox, poison, bad_cfg, healthy)
            d.wake()
            await async_wait_until(lambda: dev.ids() == [healthy.id], what="the healthy command arrives")
            await async_wait_until(lambda: states(settings)[poison.id] == "failed", what="poison failed")
            row = next(r for r in read_commands(settings.buffer_path) if r.id == poison.id)
            assert "not published" in row.detail
            assert _config_state(settings, "dev\x1bx") == "failed"
            assert metrics.value("iggy_edge_downlink_commands_total", state="failed") == 1
    finally:
        await dev.stop()


async def test_commands_and_configs_go_to_the_layouts_topics(tmp_path: Path, broker: Broker) -> None:
    """The device topics come from `settings.topics` (topics.py), so a
    `topic_prefix` moves them with the rest of the layout."""
    settings = downlink_settings(tmp_path, broker, topic_prefix="site/a")
    dev = await DeviceSubscriber(broker.host, broker.port, "site/a/dev-1/down/#").start()
    try:
        async with deliverer(settings) as (d, inbox, _):
            await put(inbox, make_command("dev-1", "blink", {}), make_config("dev-1", {"rate": 2}))
            d.wake()
            await async_wait_until(lambda: len(dev.messages) == 2, what="device got both")
            assert {m.topic for m in dev.messages} == {"site/a/dev-1/down/cmd", "site/a/dev-1/down/config"}
    finally:
        await dev.stop()
