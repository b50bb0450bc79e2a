"""Per-device bounds (issue 18 items 5-7): a device's distinct topics and the
devices tracked are capped (dead letters too_many_topics / too_many_devices),
orphaned sources leave the table, dead letters stay inside their byte bound,
and drop_oldest takes from the device with the largest share first."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from iggy_edge.buffer_admin import read_stats
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import publish_all
from tests.support.wait import async_wait_until

GW = "gw-bounds"
BIG = 1 << 40


def reading(device: str, n: int, topic: str | None = None) -> Incoming:
    return Incoming(
        Route("edge", "telemetry", device),
        topic or f"edge/{device}/up/env",
        1,
        False,
        n,
        b'{"seq":%d,"t":21.5}' % n,
        n,
    )


async def open_box(path: Path, **kw: object) -> Outbox:
    kw.setdefault("commit_interval_ms", 0)
    box = await Outbox.open(path, BufferSettings(**kw), GW, Metrics())  # type: ignore[arg-type]
    box.start()
    return box


def table_count(path: Path, table: str) -> int:
    with sqlite3.connect(path) as c:
        return int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


def per_device(rows: list[tuple[str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (k,) in rows:
        out[k] = out.get(k, 0) + 1
    return out


# -- item 7: fairness at the bound ---------------------------------------------------


async def test_a_flood_does_not_evict_a_quiet_devices_readings(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    box = await open_box(path, max_records=1000)
    try:
        for f in [box.submit(reading("quiet", i)) for i in range(100)]:
            await f
        for start in range(0, 3000, 200):  # groups of 200, as a flood commits
            for f in [box.submit(reading("flood", i)) for i in range(start, start + 200)]:
                await f
        batch = await box.read_batch(BIG, BIG)
    finally:
        await box.close()
    got = per_device([(r.key,) for r in batch])
    assert got == {"quiet": 100, "flood": 900}
    # the flood lost its own oldest: what is left of it are its newest readings, in order
    flood = [int(r.headers["device-seq"]) for r in batch if r.key == "flood"]
    assert flood == list(range(2100, 3000))
    assert read_stats(path).drops_by_reason["buffer_full_oldest"] == 2100


async def test_devices_above_the_fair_share_give_down_to_a_common_level(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    box = await open_box(path, max_records=300)
    try:
        for dev, n in (("a", 200), ("b", 80), ("c", 20)):
            for f in [box.submit(reading(dev, i)) for i in range(n)]:
                await f
        for f in [box.submit(reading("d", i)) for i in range(150)]:  # 150 over the bound
            await f
        got = per_device([(r.key,) for r in await box.read_batch(BIG, BIG)])
    finally:
        await box.close()
    # water level 100: a gives 100, d 50 of its new ones (its oldest), b and c keep all
    assert got == {"a": 100, "b": 80, "c": 20, "d": 100}


async def test_the_byte_bound_is_fair_too(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    box = await open_box(path, max_bytes=40_000)
    try:
        quiet = Incoming(Route("edge", "t", "quiet"), "edge/quiet/up/env", 1, False, 1, b"q" * 100)
        await box.submit(quiet)
        for i in range(100):
            await box.submit(Incoming(Route("edge", "t", "big"), "edge/big/up/env", 1, False, i, b"b" * 2000))
        got = per_device([(r.key,) for r in await box.read_batch(BIG, BIG)])
        assert box.bytes <= 40_000
    finally:
        await box.close()
    assert got["quiet"] == 1
    assert 15 <= got["big"] <= 20


# -- item 5: topics per device, devices tracked, orphaned sources ---------------------


async def test_a_device_gets_at_most_max_topics_per_device(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker, buffer={"max_topics_per_device": 10, "max_devices": 5})
    async with running_agent(settings) as agent:
        msgs = [(f"edge/d1/up/ch{i}", b'{"v":1}') for i in range(100)]
        msgs += [(f"edge/dev{i}/up/env", b'{"v":1}') for i in range(20)]
        await publish_all(broker.host, broker.port, "topic-flood", msgs, qos=1)
        m = agent.metrics
        await async_wait_until(
            lambda: (
                m.value("iggy_edge_store_records_committed_total")
                + m.value("iggy_edge_store_dead_letters_total", reason="too_many_topics")
                + m.value("iggy_edge_store_dead_letters_total", reason="too_many_devices")
                == 120
            ),
            20,
        )
        assert m.value("iggy_edge_store_dead_letters_total", reason="too_many_topics") == 90
        # d1 and four more devices; the other 16 device levels are refused
        assert m.value("iggy_edge_store_dead_letters_total", reason="too_many_devices") == 16
        assert m.value("iggy_edge_store_records_committed_total") == 14
        assert m.value("iggy_edge_store_devices") == 5
    path = settings.buffer_path
    assert table_count(path, "sources") == 14
    with sqlite3.connect(path) as c:
        reasons = dict(c.execute("SELECT reason, count(*) FROM dead_letters GROUP BY reason").fetchall())
    assert reasons == {"too_many_topics": 90, "too_many_devices": 16}


async def test_sources_of_dropped_and_forwarded_rows_make_room(tmp_path: Path) -> None:
    """Rows dropped by drop_oldest (or forwarded) leave their sources orphaned:
    they no longer count against the device's topics, and the table loses
    them (at the next commit that needs the room, and when the outbox opens)."""
    path = tmp_path / "buffer.db"
    box = await open_box(path, max_records=5, max_topics_per_device=8)
    try:
        for i in range(40):  # 40 topics, 5 rows kept: the device is never over its 8 topics
            route = Route("edge", "t", "d")
            topic = f"edge/d/up/ch{i}"
            assert box.admit(route, topic) is None, i
            await box.submit(Incoming(route, topic, 1, False, i, b"x"))
        assert table_count(path, "sources") <= 8 + 1
        assert len(box.catalog.source_names) <= 8
    finally:
        await box.close()
    box = await open_box(path, max_records=5, max_topics_per_device=8)
    try:
        assert len(box.catalog.source_names) == 5
    finally:
        await box.close()
    assert table_count(path, "sources") == 5


async def test_devices_whose_rows_left_free_their_slot(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    box = await open_box(path, max_devices=3)
    try:
        for dev in ("a", "b", "c"):
            assert box.admit(Route("edge", "t", dev), f"edge/{dev}/up/x") is None
            await box.submit(reading(dev, 1, f"edge/{dev}/up/x"))
        refused = box.admit(Route("edge", "t", "d"), "edge/d/up/x")
        assert refused is not None
        assert refused.reason.value == "too_many_devices"
        batch = await box.read_batch(BIG, BIG)
        await box.confirm([r for r in batch if r.key == "a"])
        assert box.admit(Route("edge", "t", "d"), "edge/d/up/x") is None
    finally:
        await box.close()


# -- item 6: dead letters inside a byte bound ---------------------------------------


async def test_dead_letters_keep_to_their_byte_bound(tmp_path: Path, broker: Broker) -> None:
    bound = 2_000_000
    settings = make_settings(tmp_path, broker, buffer={"max_dead_letter_bytes": bound})
    async with running_agent(settings) as agent:
        # 60 invalid-topic 100 kB letters (kept whole) and 40 oversize ones
        msgs = [(f"edge/d/up/{'x' * 300}{i}", b"u" * 100_000) for i in range(60)]
        msgs += [("edge/d/up/env", b"o" * 300_000) for _ in range(40)]
        await publish_all(broker.host, broker.port, "dead-flood", msgs, qos=1)
        m = agent.metrics
        await async_wait_until(
            lambda: (
                sum(
                    m.value("iggy_edge_store_dead_letters_total", reason=r)
                    for r in ("oversize", "invalid_topic")
                )
                == 100
            ),
            20,
        )
        assert 0 < m.value("iggy_edge_store_dead_letter_bytes") <= bound
    st = read_stats(settings.buffer_path)
    assert 0 < st.dead_letter_bytes <= bound
    with sqlite3.connect(settings.buffer_path) as c:
        rows = c.execute(
            "SELECT length(payload), payload_size, detail FROM dead_letters WHERE reason = 'oversize'"
        )
        oversize = rows.fetchall()
    assert len(oversize) == 40  # the oldest (invalid_topic) went first
    assert all(kept == 1024 and size == 300_000 and "sha256 " in detail for kept, size, detail in oversize)
