"""The whole uplink path in one process: real Mosquitto, the agent, and the
in-memory Iggy (fault injection at the boundary we own)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import read_stats
from iggy_edge.metrics import Metrics
from iggy_edge.records import OutboundRecord
from iggy_edge.runtime import Agent
from iggy_edge.uplink.memory import MemoryIggy, MemoryUplink
from iggy_edge.uplink.protocol import Lane

from tests.support.agent import make_settings, running_agent, wait_subscribed
from tests.support.broker import Broker
from tests.support.mqtt import Publisher, publish_all
from tests.support.wait import async_wait_until


async def stream(broker: Broker, devices: Sequence[str], per_device: int, interval: float) -> Publisher:
    """Each device publishes `per_device` QoS1 readings with its own seq,
    interleaved, one round every `interval` seconds."""
    pub = await Publisher(broker.host, broker.port, f"pub-{devices[0]}").connect()
    for seq in range(per_device):
        for d in devices:
            await pub.publish(f"edge/{d}/up/env", json.dumps({"seq": seq}).encode(), tag=(d, seq))
        await asyncio.sleep(interval)
    await pub.wait_all_acked(30)
    await pub.close()
    return pub


def stored(iggy: MemoryIggy, topic: str = "telemetry") -> list[tuple[str, int, int]]:
    """(key, device seq, message id) of everything stored, per partition in offset order."""
    out = []
    for p in range(len(iggy.topics.get(("edge", topic), []))):
        part = iggy.partition("edge", topic, p)
        for rec in part.records:
            assert rec is not None
            out.append((rec.key, int(rec.headers["device-seq"]), rec.message_id))
    return out


def forwarded(agent: Agent) -> float:
    return agent.metrics.value("iggy_edge_forward_records_total")


async def test_uplink_outage_loses_nothing_and_keeps_order(tmp_path: Path, broker: Broker) -> None:
    iggy = MemoryIggy()
    devices = [f"dev-out-{i}" for i in range(4)]
    per_device = 150
    total = per_device * len(devices)
    settings = make_settings(tmp_path, broker, forward={"batch_records": 50})
    async with running_agent(settings, iggy.uplink()) as agent:
        assert agent.outbox is not None
        outbox = agent.outbox
        streaming = asyncio.create_task(stream(broker, devices, per_device, 0.01))
        await async_wait_until(lambda: iggy.count() > 50, 10, what="forwarding under way")
        iggy.down = True
        down_at = time.monotonic()
        backlog_peak = 0
        while time.monotonic() - down_at < 2.0:
            backlog_peak = max(backlog_peak, outbox.records)
            await asyncio.sleep(0.05)
        count_while_down = iggy.count()
        iggy.down = False
        pub = await streaming
        await async_wait_until(lambda: iggy.count() >= total and outbox.records == 0, 20, what="drain")
        assert agent.metrics.value("iggy_edge_forward_errors_total", kind="unavailable") > 0
        assert agent.metrics.value("iggy_edge_store_backlog_records") == 0
    assert backlog_peak > 50, "the outage should have built a backlog"
    assert count_while_down < total
    assert len(pub.acked) == total
    rows = stored(iggy)
    assert len(rows) == total  # unavailable = nothing stored: no duplicates
    for d in devices:
        assert [s for k, s, _ in rows if k == d] == list(range(per_device))


async def test_ambiguous_failures_duplicate_with_the_same_id(tmp_path: Path, broker: Broker) -> None:
    iggy = MemoryIggy()
    devices = [f"dev-amb-{i}" for i in range(3)]
    per_device = 100
    total = per_device * len(devices)
    settings = make_settings(tmp_path, broker, forward={"batch_records": 40})
    async with running_agent(settings, iggy.uplink()) as agent:
        assert agent.outbox is not None
        outbox = agent.outbox
        iggy.fail_next(2, ambiguous=True, after=2)
        iggy.fail_next(1, ambiguous=True, after=5)
        await stream(broker, devices, per_device, 0.005)
        await async_wait_until(lambda: outbox.records == 0 and forwarded(agent) == total, 20, what="drain")
        retries = agent.metrics.value("iggy_edge_forward_ambiguous_retries_total")
        assert agent.metrics.value("iggy_edge_forward_errors_total", kind="ambiguous") == 3
    rows = stored(iggy)
    ids: dict[tuple[str, int], int] = {}
    for key, seq, mid in rows:
        assert ids.setdefault((key, seq), mid) == mid, "a duplicate must carry the same message id"
    assert len(ids) == total  # every message, once by id
    assert len({mid for _, _, mid in rows}) == total
    duplicates = len(rows) - total
    assert duplicates > 0, "the injected ambiguous failures should have stored copies"
    assert retries >= duplicates  # every copy was counted as a possible duplicate
    for d in devices:
        firsts: list[int] = []
        for k, s, _ in rows:
            if k == d and s not in firsts:
                firsts.append(s)
        assert firsts == list(range(per_device))


@pytest.mark.parametrize(
    ("overflow", "kept", "reason"),
    [
        ("drop_oldest", range(70, 120), "buffer_full_oldest"),
        ("reject_new", range(50), "buffer_full_rejected"),
    ],
)
async def test_full_buffer_end_to_end(
    tmp_path: Path, broker: Broker, overflow: str, kept: range, reason: str
) -> None:
    device = f"dev-full-{overflow}"
    settings = make_settings(tmp_path, broker, buffer={"max_records": 50, "overflow": overflow})
    async with running_agent(settings) as agent:  # no uplink: everything stays in the outbox
        m = agent.metrics
        # one message at a time so each commit group holds one record
        for i in range(120):
            await publish_all(
                broker.host, broker.port, "pub-full", [(f"edge/{device}/up/env", b'{"seq":%d}' % i)]
            )
        # all 120 received, and every handler returned (committed or dropped by policy, acknowledged)
        assert agent.ingest is not None
        ingest = agent.ingest
        await async_wait_until(
            lambda: m.value("iggy_edge_ingest_messages_total", qos="1") == 120 and ingest._idle.is_set(), 20
        )
        assert agent.outbox is not None
        batch = await agent.outbox.read_batch(1000, 1 << 30)
        assert [json.loads(r.payload)["seq"] for r in batch] == list(kept)
        assert m.value("iggy_edge_store_dropped_records_total", reason=reason) == 70
        assert agent.health().ingest == "up"
    assert read_stats(settings.buffer_path).drops_by_reason == {reason: 70}


class GatedUplink(MemoryUplink):
    """A MemoryUplink whose sends take `delay` seconds and say when one starts."""

    def __init__(self, iggy: MemoryIggy, delay: float) -> None:
        super().__init__(iggy)
        self.delay = delay
        self.sending = asyncio.Event()
        self.in_flight: list[int] = []

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        self.in_flight = [r.seq for r in batch]
        self.sending.set()
        await asyncio.sleep(self.delay)
        await super().send(batch)

    async def send_lane(self, lane: Lane, records: Sequence[OutboundRecord]) -> None:
        # the forwarder's path (one request per partition)
        self.in_flight = [r.seq for r in records]
        self.sending.set()
        await asyncio.sleep(self.delay)
        await super().send_lane(lane, records)


@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_stop_finishes_the_batch_in_flight_within_the_bound(tmp_path: Path, broker: Broker) -> None:
    iggy = MemoryIggy()
    uplink = GatedUplink(iggy, delay=1.0)
    settings = make_settings(tmp_path, broker, forward={"batch_records": 20, "linger_ms": 0})
    agent = Agent(settings, uplink=uplink, metrics=Metrics(), shutdown_timeout_s=5.0)
    task = asyncio.create_task(agent.run())
    await asyncio.wait_for(agent.ready.wait(), 10)
    await wait_subscribed(agent)
    await publish_all(
        broker.host, broker.port, "pub-stop", [("edge/dev-stop/up/env", b'{"seq":%d}' % i) for i in range(50)]
    )
    await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == 50, 10)
    uplink.sending.clear()
    await asyncio.wait_for(uplink.sending.wait(), 10)
    in_flight = list(uplink.in_flight)
    started = time.monotonic()
    agent.stop()
    await asyncio.wait_for(task, 10)
    took = time.monotonic() - started
    assert took < 5.0 + 1.0, f"stop took {took:.1f}s"
    assert in_flight
    sent = {r.seq for p in iggy.topics[("edge", "telemetry")] for r in p.records if r is not None}
    assert set(in_flight) <= sent, "the batch in flight was finished"
    stats = read_stats(settings.buffer_path)
    assert stats.records == 50 - len(sent), "what Iggy confirmed is gone from the outbox, the rest stays"
    assert uplink.closed
