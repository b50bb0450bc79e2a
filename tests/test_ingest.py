"""Ingest against a real Mosquitto: acknowledge after commit, persistent
session, QoS0, dead letters, headers, redelivery.

The broker fixture raises Mosquitto's `max_queued_messages` (default 1000)
to 1,000,000, as the shipped broker config does; the persistent-session test
relies on it, since it queues 5000 messages for the stopped agent.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from iggy_edge.buffer_admin import read_dead_letters
from iggy_edge.records import split_message_id
from iggy_edge.routing import MAX_TOPIC_BYTES
from iggy_edge.runtime import Agent
from iggy_edge.store import device_seq_of
from iggy_edge.store.commit import Item
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import Publisher, agent_transport, publish_all
from tests.support.wait import async_wait_until

BIG = 1 << 40


def reading(seq: int, **extra: Any) -> bytes:
    return json.dumps({"seq": seq, **extra}, separators=(",", ":")).encode()


async def outbox_rows(agent: Agent) -> list[tuple[str, int | None]]:
    assert agent.outbox is not None
    return [(r.key, device_seq_of(r.payload)) for r in await agent.outbox.read_batch(BIG, BIG)]


def kill_connection(agent: Agent) -> None:
    """Drop the agent's TCP connection to the broker at once, without a
    DISCONNECT: what the broker sees when the agent process dies."""
    assert agent.ingest is not None
    assert agent.ingest.client is not None
    agent_transport(agent.ingest.client).abort()


async def test_qos1_is_acknowledged_only_after_commit(tmp_path: Path, broker: Broker) -> None:
    """While the commit is held, nothing is acknowledged: when the connection
    dies and those commits never happen, the broker redelivers every message
    to the restarted agent.  (With optimistic acknowledgement the broker
    would have forgotten them and the second agent would get nothing.)"""
    settings = make_settings(tmp_path, broker)
    n = 20
    release = asyncio.Event()
    held: list[Item] = []

    async def held_then_failed(items: list[Item]) -> None:
        held.extend(items)
        await release.wait()
        raise sqlite3.OperationalError("simulated: the process died before this commit")

    async with running_agent(settings) as agent:
        assert agent.outbox is not None
        agent.outbox.commit._insert = held_then_failed  # type: ignore[method-assign]  # noqa: SLF001 - fault at the SQL seam
        await publish_all(
            broker.host, broker.port, "pub-ack", [("edge/dev-ack/up/env", reading(i)) for i in range(n)]
        )
        await async_wait_until(
            lambda: agent.outbox is not None and len(held) + agent.outbox.pending_count == n,
            10,
            what="all messages handed to the outbox",
        )
        kill_connection(agent)
        release.set()
        assert agent.outbox.records == 0
    async with running_agent(settings) as agent:
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == n, 15)
        assert await outbox_rows(agent) == [("dev-ack", i) for i in range(n)]


async def test_persistent_session_queues_while_agent_is_stopped(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings):
        pass  # creates the session and its subscriptions, then stops
    devices = [f"dev-ps-{i}" for i in range(5)]
    msgs = [(f"edge/{d}/up/env", reading(i)) for i in range(1000) for d in devices]
    assert len(msgs) == 5000  # more than Mosquitto's default max_queued_messages (1000)
    await publish_all(broker.host, broker.port, "pub-ps", msgs)
    async with running_agent(settings) as agent:
        await async_wait_until(
            lambda: agent.outbox is not None and agent.outbox.records == 5000, 60, what="5000 records"
        )
        rows = await outbox_rows(agent)
    for d in devices:
        assert [s for k, s in rows if k == d] == list(range(1000))


async def test_qos0_is_buffered(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings) as agent:
        await publish_all(
            broker.host, broker.port, "pub-q0", [("edge/dev-q0/up/env", reading(i)) for i in range(10)], qos=0
        )
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == 10, 10)
        assert agent.outbox is not None
        batch = await agent.outbox.read_batch(BIG, BIG)
        assert {r.headers["mqtt-qos"] for r in batch} == {"0"}
        assert agent.metrics.value("iggy_edge_ingest_messages_total", qos="0") == 10


async def test_bad_input_goes_to_dead_letters_and_the_agent_keeps_running(
    tmp_path: Path, broker: Broker
) -> None:
    settings = make_settings(
        tmp_path,
        broker,
        mqtt={"subscriptions": [{"filter": "#", "qos": 1}]},
        buffer={"max_payload_bytes": 100},
    )
    long_topic = "edge/dev-dl/up/" + "x" * 1100
    async with running_agent(settings) as agent:
        await publish_all(
            broker.host,
            broker.port,
            "pub-dl",
            [
                ("edge/dev-dl/up/env", b"z" * 101),  # oversize
                ("elsewhere/dev-dl/x", b"{}"),  # no route
                (long_topic, b"{}"),  # invalid: topic longer than MAX_TOPIC_BYTES
                ("edge/dev-dl/up/env", reading(1)),  # a good one after all that
            ],
        )
        m = agent.metrics
        await async_wait_until(
            lambda: sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012") == 4, 10
        )
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == 1, 10)
        # the dead letters commit on their own path: the good record's commit
        # can land first, so wait for them rather than read them once
        reasons = ("oversize", "unroutable", "invalid_topic")
        await async_wait_until(
            lambda: all(m.value("iggy_edge_store_dead_letters_total", reason=r) >= 1 for r in reasons), 10
        )
        assert [m.value("iggy_edge_store_dead_letters_total", reason=r) for r in reasons] == [1, 1, 1]
        assert agent.health().ingest == "up"
        assert agent.health().store == "ok"
    letters = {d.reason: d for d in read_dead_letters(settings.buffer_path)}
    assert set(letters) == {"oversize", "unroutable", "invalid_topic"}
    assert letters["oversize"].payload_size == 101
    assert len(letters["oversize"].payload) == 100  # kept, truncated to the limit
    assert letters["unroutable"].mqtt_topic == b"elsewhere/dev-dl/x"
    assert f"longer than {MAX_TOPIC_BYTES} bytes" in letters["invalid_topic"].detail
    assert all(d.qos == 1 for d in letters.values())


async def test_headers_and_retain_flag_reach_the_uplink(tmp_path: Path, broker: Broker) -> None:
    # retained before the agent subscribes: delivered to it with retain=1
    await publish_all(broker.host, broker.port, "dev-hd", [("edge/dev-hd/status", b"online")], retain=True)
    iggy = MemoryIggy()
    settings = make_settings(tmp_path, broker, gateway_id="gw-headers")
    before_us = time.time_ns() // 1000
    async with running_agent(settings, iggy.uplink()) as agent:
        await publish_all(broker.host, broker.port, "dev-hd", [("edge/dev-hd/up/env", reading(7, t=21.5))])
        await async_wait_until(lambda: iggy.count() == 2, 10, what="both records forwarded")
        assert agent.outbox is not None
        epoch = agent.outbox.epoch
    after_us = time.time_ns() // 1000
    (status,) = (
        [m for p in range(3) for m in iggy.messages("edge", "events", p)]
        if (
            "edge",
            "events",
        )
        in iggy.topics
        else []
    )
    (env,) = [m for p in range(3) for m in iggy.messages("edge", "telemetry", p)]
    assert status.headers["mqtt-topic"] == "edge/dev-hd/status"
    assert status.headers["mqtt-retain"] == "1"
    assert status.headers["mqtt-qos"] == "1"
    assert "device-seq" not in status.headers
    assert status.payload == b"online"
    assert env.headers["mqtt-topic"] == "edge/dev-hd/up/env"
    assert env.headers["mqtt-retain"] == "0"
    assert env.headers["device-seq"] == "7"
    assert env.payload == reading(7, t=21.5)
    for msg in (status, env):
        assert msg.headers["gateway-id"] == "gw-headers"
        assert before_us <= int(msg.headers["received-at-us"]) <= after_us
        assert split_message_id(msg.message_id)[1] == epoch
    assert iggy.ids_by_key("edge", "telemetry") == {"dev-hd": [env.message_id]}
    assert status.message_id != env.message_id


async def test_redelivery_of_a_committed_message_is_not_stored_twice(tmp_path: Path, broker: Broker) -> None:
    """The agent dies between commit and PUBACK: the broker redelivers (DUP)
    and the outbox recognises the device seq, so the record keeps one id."""
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings) as agent:
        assert agent.outbox is not None
        outbox = agent.outbox
        real_insert = outbox.commit._insert  # noqa: SLF001 - fault at the SQL seam
        crashed = asyncio.Event()

        async def commit_then_die(items: list[Item]) -> None:
            await real_insert(items)
            if not crashed.is_set():
                crashed.set()
                kill_connection(agent)  # committed, but the PUBACK never leaves

        outbox.commit._insert = commit_then_die  # type: ignore[method-assign]  # noqa: SLF001 - fault at the SQL seam
        pub = await Publisher(broker.host, broker.port, "pub-redeliver").connect()
        try:
            await pub.publish("edge/dev-rd/up/env", reading(1), tag=1)
            await pub.wait_all_acked()
        finally:
            await pub.close()
        await asyncio.wait_for(crashed.wait(), 10)
        m = agent.metrics
        await async_wait_until(
            lambda: m.value("iggy_edge_ingest_messages_total", qos="1") == 2,
            15,
            what="the broker's redelivery",
        )
        # a later message still flows, and the redelivered one was not stored again
        await publish_all(broker.host, broker.port, "pub-redeliver", [("edge/dev-rd/up/env", reading(2))])
        await async_wait_until(lambda: m.value("iggy_edge_store_records_committed_total") == 2, 10)
        assert await outbox_rows(agent) == [("dev-rd", 1), ("dev-rd", 2)]


async def test_ingest_recovers_in_the_same_process_when_the_store_works_again(
    tmp_path: Path, broker: Broker
) -> None:
    """A failed commit (disk full, I/O error) acknowledges nothing and shows in
    health; once the store works again the supervisor's restart of ingest
    takes the broker's redeliveries, without restarting the agent."""
    settings = make_settings(tmp_path, broker)
    n = 10
    failing = True

    async with running_agent(settings) as agent:
        assert agent.outbox is not None
        real_insert = agent.outbox.commit._insert  # noqa: SLF001 - fault at the SQL seam

        async def flaky_insert(items: list[Item]) -> None:
            if failing:
                raise sqlite3.OperationalError("simulated: database or disk is full")
            await real_insert(items)

        agent.outbox.commit._insert = flaky_insert  # type: ignore[method-assign]  # noqa: SLF001 - fault at the SQL seam
        await publish_all(
            broker.host, broker.port, "pub-disk", [("edge/dev-disk/up/env", reading(i)) for i in range(n)]
        )
        await async_wait_until(lambda: agent.health().store == "failed", 10, what="health shows the store")
        assert agent.outbox.records == 0
        failing = False
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == n, 30)
        assert await outbox_rows(agent) == [("dev-disk", i) for i in range(n)]
        await async_wait_until(lambda: agent.health().store == "ok", 10, what="health recovers")
