"""Fuzz of the device boundary (issue 18): arbitrary MQTT topics and payloads
from devices, through the real Mosquitto and the real agent (ingest, routing,
outbox), and the pure routing function.  Invariant: every message is stored
or dead-lettered with a reason, and the per-device bounds hold (devices
tracked, topics per device, sources in the table, dead-letter bytes)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iggy_edge.config import RouteSettings
from iggy_edge.records import Route
from iggy_edge.routing import MAX_TOPIC_BYTES, DeadLetterReason, Rejected, Router

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import publish_all
from tests.support.wait import async_wait_until


def _broker_takes(c: str) -> bool:
    """Mosquitto closes a publisher whose topic has a control character (C0,
    DEL, C1) or a noncharacter; those never reach the agent (the pure routing
    test below covers them)."""
    o = ord(c)
    return o >= 0x20 and not 0x7F <= o <= 0x9F and not 0xFDD0 <= o <= 0xFDEF and (o & 0xFFFE) != 0xFFFE


# a topic level: any unicode the broker passes on, sometimes long; never '/',
# '+' or '#' (a wildcard in a PUBLISH topic is a protocol error)
LEVEL = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/+#").filter(
        _broker_takes
    ),
    max_size=80,
)
DEVICE = st.one_of(st.sampled_from(["d1", "d2", "d3"]), LEVEL.filter(bool))
TOPIC = st.builds(
    lambda dev, rest: "/".join(["edge", dev, "up", *rest]),
    DEVICE,
    st.lists(LEVEL, min_size=1, max_size=12),
)
PAYLOAD = st.one_of(st.binary(max_size=300), st.just(b""), st.binary(min_size=2000, max_size=3000))

RULES = [RouteSettings(filter="edge/+/up/#", stream="edge", topic="telemetry", key_level=1)]


@settings(max_examples=400, deadline=None)
@given(
    topic=st.one_of(TOPIC, st.text(max_size=300), st.binary(max_size=300)).map(
        lambda t: t + "\x07\x9b" if isinstance(t, str) and len(t) % 3 == 0 else t  # control characters too
    ),
    size=st.integers(0, 5000),
)
def test_route_is_a_route_or_a_reason(topic: str | bytes, size: int) -> None:
    got = Router(RULES, 2048).route(topic, size)
    if isinstance(got, Rejected):
        assert isinstance(got.reason, DeadLetterReason)
        assert got.detail
        return
    assert isinstance(got, Route)
    assert isinstance(topic, str)
    assert 0 < size <= 2048
    assert len(topic.encode()) <= MAX_TOPIC_BYTES
    assert got.key == topic.split("/")[1]
    assert got.key


MAX_DEVICES = 4
MAX_TOPICS = 3
DEAD_BYTES = 200_000


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(messages=st.lists(st.tuples(TOPIC, PAYLOAD), min_size=1, max_size=40))
def test_device_traffic_is_stored_or_dead_lettered_within_bounds(
    tmp_path_factory: object, broker: Broker, messages: list[tuple[str, bytes]]
) -> None:
    tmp = Path(str(tmp_path_factory.mktemp("fuzz")))  # type: ignore[attr-defined]
    asyncio.run(_run(tmp, broker, messages))


async def _run(tmp: Path, broker: Broker, messages: list[tuple[str, bytes]]) -> None:
    settings = make_settings(
        tmp,
        broker,
        buffer={
            "max_devices": MAX_DEVICES,
            "max_topics_per_device": MAX_TOPICS,
            "max_payload_bytes": 2048,
            "max_dead_letter_bytes": DEAD_BYTES,
        },
    )
    async with running_agent(settings) as agent:
        assert agent.outbox is not None
        await publish_all(broker.host, broker.port, "fuzz-dev", messages, qos=1)
        m = agent.metrics

        def settled() -> float:
            return m.value("iggy_edge_store_records_committed_total") + sum(
                m.value("iggy_edge_store_dead_letters_total", reason=r.value) for r in DeadLetterReason
            )

        # every PUBACK came after a commit: all are settled already, one way or the other
        await async_wait_until(lambda: settled() == len(messages), 10)
        box = agent.outbox
        assert len(box.devices.by_key) <= MAX_DEVICES
        assert all(len(d.topics) <= MAX_TOPICS for d in box.devices.by_key.values())
        assert box.dead_bytes <= DEAD_BYTES
    with sqlite3.connect(settings.buffer_path) as c:
        records = c.execute("SELECT count(*) FROM outbox").fetchone()[0]
        dead = c.execute("SELECT count(*), coalesce(sum(reason != ''), 0) FROM dead_letters").fetchone()
        sources = c.execute("SELECT count(*) FROM sources").fetchone()[0]
        per_device = c.execute(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM sources GROUP BY pkey)"
        ).fetchone()
    assert sources <= MAX_DEVICES * MAX_TOPICS
    assert (per_device[0] or 0) <= MAX_TOPICS
    assert dead[0] == dead[1]  # every dead letter has a reason
    assert records + dead[0] <= len(messages)
