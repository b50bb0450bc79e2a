"""The return path inside a running agent: real Mosquitto, MemoryIggy in
process (and a real iggy-server when one is on PATH).

"Hard kill" below cancels the agent's task: no orderly stop, the return path
is torn down wherever it was awaiting.  SQLite holds only what was committed,
exactly as after SIGKILL; the MemoryIggy lives on, as the Iggy server would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import read_dead_letters
from iggy_edge.config import Settings
from iggy_edge.downlink.commands import (
    Command,
    DesiredConfig,
    make_command,
    make_config,
    return_topic,
)
from iggy_edge.inbox_admin import read_commands
from iggy_edge.runtime import build_agent
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.iggy import IggyCommandSource, send_command
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.agent import wait_subscribed
from tests.support.broker import Broker
from tests.support.downlink import FreezableProxy, downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.provisioning import provision
from tests.support.return_path import (
    MARKER,
    Running,
    before_marker,
    device,
    publish,
    running,
    send,
    send_raw,
    states,
    stored_offset,
)
from tests.support.wait import async_wait_until

# -- end to end -------------------------------------------------------------------


async def test_command_reaches_the_device_is_acked_and_the_offset_is_mirrored(
    tmp_path: Path, broker: Broker
) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy(partitions=3)
    async with device(broker) as dev, running(settings, iggy) as r:
        cmd = make_command("dev-1", "relay", {"on": True})
        offset = send(iggy, settings, cmd)
        await async_wait_until(lambda: dev.ids() == [cmd.id], what="device got the command")
        await async_wait_until(lambda: states(settings)[cmd.id] == "delivered", what="delivered")
        # The device acknowledges on up/ack, like device/iggy_device does.
        # Device acks go through ingest: its subscriptions must be in place
        # (the return path can deliver before ingest has subscribed).
        await wait_subscribed(r.agent)
        await publish(broker, "edge/dev-1/up/ack", json.dumps({"id": cmd.id, "status": "ok"}).encode())
        await async_wait_until(lambda: states(settings)[cmd.id] == "acked", what="acked")
        # ... and the ack travels uplink like telemetry, for the cloud side.
        await async_wait_until(lambda: iggy.count("edge", "acks") == 1, what="ack forwarded to Iggy")
        rt = return_topic(settings)
        assert stored_offset(settings) == offset
        await async_wait_until(
            lambda: iggy.stored_offset(consumer_name(settings), rt.stream, rt.topic, 0) == offset,
            what="offset mirrored to the server",
        )
        for state in ("received", "delivered", "acked"):
            assert r.metric("iggy_edge_downlink_commands_total", state=state) == 1


async def test_device_error_ack_marks_the_command_failed(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with device(broker) as dev, running(settings, iggy) as r:
        cmd = make_command("dev-1", "nope")
        send(iggy, settings, cmd)
        await async_wait_until(lambda: dev.ids() == [cmd.id], what="device got it")
        ack = {"id": cmd.id, "status": "unknown_command", "error": "nope"}
        await wait_subscribed(r.agent)  # as above
        await publish(broker, "edge/dev-1/up/ack", json.dumps(ack).encode())
        await async_wait_until(lambda: states(settings)[cmd.id] == "failed", what="failed by device ack")
        row = next(x for x in read_commands(settings.buffer_path) if x.id == cmd.id)
        assert row.detail == "device: nope"
        assert r.metric("iggy_edge_downlink_commands_total", state="failed") == 1


async def test_malformed_commands_are_dead_lettered_and_consumed(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    bad = [
        b"not json",
        b"[1, 2]",
        json.dumps({"id": "x1", "name": "n"}).encode(),  # no device
        json.dumps({"id": "x2", "device": "a/b", "name": "n"}).encode(),  # device is not one topic level
        json.dumps({"id": "x3", "device": "dev-1", "name": "n", "args": [1]}).encode(),
        json.dumps({"id": "x4", "device": "dev-1", "name": "n", "expires_at": "soon"}).encode(),
        # over what a device accepts (MAX_DEVICE_PAYLOAD_BYTES): it would throw it away unread
        json.dumps({"id": "x5", "device": "dev-1", "name": "n", "args": {"blob": "x" * 5000}}).encode(),
    ]
    async with device(broker) as dev, running(settings, iggy) as r:
        for payload in bad:
            send_raw(iggy, settings, payload)
        good = make_command("dev-1", "after-the-bad-ones")
        last = send(iggy, settings, good)
        await async_wait_until(lambda: dev.ids() == [good.id], what="the good command still arrives")
        dead = read_dead_letters(settings.buffer_path)
        assert len(dead) == len(bad)
        assert {d.reason for d in dead} == {"invalid_command"}
        assert sorted(d.payload for d in dead) == sorted(bad)
        rt = return_topic(settings)
        assert all(d.mqtt_topic.startswith(f"iggy:{rt.stream}/{rt.topic}/0@".encode()) for d in dead)
        assert r.metric("iggy_edge_store_dead_letters_total", reason="invalid_command") == len(bad)
        assert stored_offset(settings) == last
        assert list(states(settings)) == [good.id]


async def test_unknown_device_is_delivered_anyway(tmp_path: Path, broker: Broker) -> None:
    """No registry: a device the agent never heard from still gets its command
    (it may be new, or asleep with a persistent session).  With no subscriber
    at all the broker still acknowledges: `delivered`, never `acked`."""
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with running(settings, iggy):
        ghost = make_command("never-seen", "hello")
        send(iggy, settings, ghost)
        await async_wait_until(lambda: states(settings).get(ghost.id) == "delivered", what="delivered")


async def test_duplicate_copy_in_iggy_is_delivered_once(tmp_path: Path, broker: Broker) -> None:
    """The cloud side's ambiguous retry leaves two copies in Iggy (no server
    de-duplication in 0.9); the command id keeps the device from getting two."""
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with device(broker) as dev, running(settings, iggy):
        cmd, after = make_command("dev-1", "once"), make_command("dev-1", "then")
        send(iggy, settings, cmd)
        send(iggy, settings, cmd)
        send(iggy, settings, after)
        # `after` comes behind both copies in the partition, and one device's
        # commands are delivered in order: once the device has `after`, a
        # wrong second copy of `cmd` would already be in front of it.
        await async_wait_until(lambda: after.id in dev.ids(), what="device got the last one")
        assert dev.ids() == [cmd.id, after.id]


async def test_retained_config_replacement_through_the_agent(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with running(settings, iggy):
        for period in (10, 20, 30):
            send(iggy, settings, make_config("dev-1", {"period_s": period}))
        await async_wait_until(lambda: stored_offset(settings) == 2, what="configs consumed")
        await async_wait_until(lambda: _config_state(settings, "dev-1") == "delivered", what="retained")
    async with device(broker, "edge/dev-1/down/config") as late:
        # Retained messages come right after the SUBACK, before anything
        # published later: everything before the marker is what was retained.
        await publish(broker, "edge/dev-1/down/config", MARKER)
        await async_wait_until(lambda: len(before_marker(late.messages)) < len(late.messages), what="marker")
        assert [(m.doc, m.retain) for m in before_marker(late.messages)] == [({"period_s": 30}, True)]


def _config_state(settings: Settings, dev: str) -> str:
    with contextlib.closing(sqlite3.connect(settings.buffer_path)) as c:
        row = c.execute("SELECT state FROM downlink_config WHERE device = ?", (dev,)).fetchone()
    return "" if row is None else str(row[0])


# -- bounds and outages -----------------------------------------------------------------


async def test_a_full_inbox_stops_the_poll_at_the_first_command_configs_before_it_are_taken(
    tmp_path: Path, broker: Broker
) -> None:
    """Commands and configs share the partition: with the inbox full, the
    poll takes what comes before the first command that does not fit and
    leaves it, and everything after it, in Iggy, in order."""
    settings = downlink_settings(tmp_path, broker, downlink={"max_inbox": 2})
    iggy = MemoryIggy()
    broker.stop()
    c = [make_command("dev-1", "step", {"i": i}) for i in range(3)]
    sent: list[Command | DesiredConfig] = [
        c[0],
        c[1],
        make_config("dev-1", {"v": 1}),
        c[2],
        make_config("dev-2", {"v": 1}),
    ]
    async with running(settings, iggy) as r:
        offsets = [send(iggy, settings, m) for m in sent]
        await async_wait_until(lambda: r.metric("iggy_edge_downlink_inbox_full_total") >= 2, what="paused")
        assert list(states(settings)) == [c[0].id, c[1].id]
        assert stored_offset(settings) == offsets[2]  # the config before c2 is taken
        assert _config_state(settings, "dev-1") == "received"
        assert _config_state(settings, "dev-2") == ""
        broker.start()
        async with device(broker) as dev:
            await async_wait_until(lambda: len(dev.ids()) == 3, timeout=20, what="all 3 commands")
            assert dev.ids() == [x.id for x in c]
            await async_wait_until(
                lambda: _config_state(settings, "dev-2") == "delivered", what="dev-2 config"
            )
        assert stored_offset(settings) == offsets[-1]


async def test_full_inbox_pauses_polling_and_commands_stay_in_iggy(tmp_path: Path, broker: Broker) -> None:
    iggy = MemoryIggy(partitions=1)
    settings = downlink_settings(
        tmp_path, broker, iggy={"kind": "memory", "partitions": 1}, downlink={"max_inbox": 3}
    )
    broker.stop()  # nothing can be delivered: the inbox fills up
    cmds = [make_command("dev-1", "step", {"i": i}) for i in range(7)]
    async with running(settings, iggy) as r:
        for c in cmds:
            send(iggy, settings, c)
        await async_wait_until(
            lambda: r.metric("iggy_edge_downlink_inbox_full_total") >= 2, what="polling paused"
        )
        assert list(states(settings)) == [c.id for c in cmds[:3]]
        assert stored_offset(settings) == 2  # the rest is still only in Iggy
        assert r.metric("iggy_edge_downlink_inbox_records") == 3
        broker.start()
        async with device(broker) as dev:
            await async_wait_until(lambda: len(dev.ids()) == 7, timeout=20, what="all 7 delivered, in order")
            assert dev.ids() == [c.id for c in cmds]


async def test_iggy_outage_does_not_stop_delivery(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    broker.stop()
    cmds = [make_command(f"dev-{i % 3}", "go", {"i": i}) for i in range(9)]
    async with running(settings, iggy) as r:
        for c in cmds:
            send(iggy, settings, c)
        await async_wait_until(lambda: len(states(settings)) == 9, what="all received")
        iggy.down = True
        await async_wait_until(
            lambda: r.metric("iggy_edge_downlink_errors_total", kind="poll") > 0, what="poll fails"
        )
        broker.start()
        async with device(broker) as dev:
            await async_wait_until(
                lambda: len(dev.ids()) == 9, timeout=20, what="delivered while Iggy is down"
            )
            await async_wait_until(lambda: set(states(settings).values()) == {"delivered"}, what="recorded")
            for d in ("dev-0", "dev-1", "dev-2"):
                assert [m.doc["id"] for m in dev.messages if m.topic == f"edge/{d}/down/cmd"] == [
                    c.id for c in cmds if c.device == d
                ]
        iggy.down = False
        late = make_command("dev-0", "after-outage")
        send(iggy, settings, late)
        await async_wait_until(lambda: states(settings).get(late.id) == "delivered", what="polling resumed")


# -- restarts --------------------------------------------------------------------------


async def test_kill_between_receiving_and_delivering(tmp_path: Path, broker: Broker) -> None:
    """Received and committed (offset too), then killed before any delivery:
    the restarted agent delivers each command once, from the inbox, without
    reading them from Iggy again."""
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    broker.stop()
    cmds = [make_command("dev-1", "go", {"i": i}) for i in range(5)]
    first = await Running(settings, iggy).start()
    for c in cmds:
        send(iggy, settings, c)
    await async_wait_until(lambda: len(states(settings)) == 5, what="received")
    await first.hard_kill()
    assert set(states(settings).values()) == {"received"}
    broker.start()
    async with device(broker) as dev, running(settings, iggy) as second:
        # A marker behind the five, for the same device: once it is there, a
        # wrong second copy of any of the five would be in front of it.
        marker = make_command("dev-1", "marker")
        send(iggy, settings, marker)
        await async_wait_until(lambda: marker.id in dev.ids(), what="the marker")
        assert dev.ids() == [c.id for c in cmds] + [marker.id]
        # Resumed after the stored offset: only the marker was read from Iggy.
        assert second.metric("iggy_edge_downlink_commands_total", state="received") == 1
        await async_wait_until(lambda: states(settings)[marker.id] == "delivered", what="marker recorded")
        assert second.metric("iggy_edge_downlink_commands_total", state="delivered") == 6


async def test_kill_between_broker_puback_and_recording_delivery(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker has the command (the device gets it) but its PUBACK never
    reaches the agent, which is killed: after the restart the device gets it
    once more with the same id (at-least-once; the device library drops the
    repeat by id).  Once recorded, a clean restart delivers nothing again."""
    proxy = await FreezableProxy(broker.port).start()
    settings = downlink_settings(tmp_path, mqtt={"host": "127.0.0.1", "port": proxy.port})
    iggy = MemoryIggy()
    caplog.set_level(logging.INFO, logger="iggy_edge.downlink.deliver")
    try:
        async with device(broker, "edge/dev-1/down/cmd") as dev:
            first = await Running(settings, iggy).start()
            await async_wait_until(
                lambda: any("deliver: connected" in m for m in caplog.messages), what="deliver client up"
            )
            proxy.freeze_replies()
            cmd = make_command("dev-1", "go")
            send(iggy, settings, cmd)
            await async_wait_until(lambda: dev.ids() == [cmd.id], what="the broker delivered it")
            assert states(settings)[cmd.id] == "received"  # the agent never saw the PUBACK
            await first.hard_kill()
            proxy.close_all()
            proxy.thaw()

            async with running(settings, iggy):
                await async_wait_until(lambda: states(settings)[cmd.id] == "delivered", what="recorded")
                await async_wait_until(lambda: len(dev.ids()) == 2, what="the repeat")
            assert dev.ids() == [cmd.id, cmd.id]

            async with running(settings, iggy) as third:  # clean restart: nothing more
                nxt = make_command("dev-1", "next")
                send(iggy, settings, nxt)
                await async_wait_until(lambda: states(settings).get(nxt.id) == "delivered", what="next")
                assert third.metric("iggy_edge_downlink_commands_total", state="delivered") == 1
            assert dev.ids() == [cmd.id, cmd.id, nxt.id]
    finally:
        await proxy.stop()


async def test_clean_restarts_never_deliver_twice(tmp_path: Path, broker: Broker) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    sent: list[Command] = []
    async with device(broker, "edge/+/down/cmd") as dev:
        for round_ in range(3):
            async with running(settings, iggy):
                batch = [make_command(f"dev-{i}", "r", {"round": round_}) for i in range(4)]
                for c in batch:
                    send(iggy, settings, c)
                sent += batch
                ids = [c.id for c in sent]
                await async_wait_until(
                    lambda ids=ids: all(states(settings).get(i) == "delivered" for i in ids),  # type: ignore[misc]
                    what="round delivered",
                )
        # One more clean restart, with a marker command through the agent: a
        # wrong repeat is made when the deliverer starts, before the marker.
        async with running(settings, iggy):
            marker = make_command("dev-0", "marker")
            send(iggy, settings, marker)
            await async_wait_until(lambda: marker.id in dev.ids(), what="the marker")
        got = dev.ids()[: dev.ids().index(marker.id)]
        assert sorted(got) == sorted(c.id for c in sent)
        assert len(got) == len(set(got)) == 12


# -- a real iggy-server ------------------------------------------------------------------


@pytest.mark.iggy
async def test_real_iggy_command_send_delivery_and_mirrored_offset(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    settings = downlink_settings(
        tmp_path,
        broker,
        iggy={
            "kind": "iggy",
            "address": iggy_server.address,
            "username": iggy_server.username,
            "password": iggy_server.password,
            "partitions": 3,
        },
    )
    await provision(settings)  # the cloud side's job: the agent creates no topic
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    try:
        async with device(broker) as dev:
            cmds = [make_command("dev-1", "go", {"i": i}) for i in range(3)]
            rt = return_topic(settings)
            for c in cmds:
                await send_command(settings.iggy, rt.stream, rt.topic, rt.partition, c.wire(), c.headers())
            await async_wait_until(lambda: dev.ids() == [c.id for c in cmds], timeout=30, what="delivered")
            await async_wait_until(lambda: stored_offset(settings) == 2, what="stored offset")
            probe = IggyCommandSource(settings.iggy, settings.gateway_id, consumer_name(settings))
            try:
                mirrored: int | None = None
                for _ in range(100):
                    mirrored = await probe.read_mirrored_offset(rt.stream, rt.topic, rt.partition)
                    if mirrored == 2:
                        break
                    await asyncio.sleep(0.1)
                assert mirrored == 2
            finally:
                await probe.close()
    finally:
        agent.stop()
        await asyncio.wait_for(task, 20)
