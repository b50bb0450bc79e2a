"""Schema version 1 -> 2 (issue 14: sources instead of per-row strings): an
old buffer file opens with every record, id, order and counter kept, and the
CLI reads an old file before the agent migrated it."""

from __future__ import annotations

import sqlite3
import zlib
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import iter_records, read_stats
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import (
    HEADER_DEVICE_SEQ,
    HEADER_MQTT_TOPIC,
    HEADER_QOS,
    HEADER_RECEIVED_US,
    HEADER_RETAIN,
    Route,
)
from iggy_edge.store import Incoming, Outbox, StoreError, reader
from iggy_edge.store.schema import ROW_OVERHEAD

pytestmark = pytest.mark.unit

GW = "gw-migrate"
BIG = 1 << 30

# The version 1 tables as iggy-edge 0.1 wrote them (store/schema.py before issue 14).
V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE routes (
    id INTEGER PRIMARY KEY, stream TEXT NOT NULL, topic TEXT NOT NULL, UNIQUE (stream, topic)
);
CREATE TABLE outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    route_id INTEGER NOT NULL,
    pkey TEXT NOT NULL,
    mqtt_topic TEXT NOT NULL,
    flags INTEGER NOT NULL,
    received_us INTEGER NOT NULL,
    device_seq INTEGER,
    payload BLOB NOT NULL
);
CREATE TABLE dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT, received_us INTEGER NOT NULL, mqtt_topic BLOB NOT NULL,
    qos INTEGER NOT NULL, retain INTEGER NOT NULL, reason TEXT NOT NULL, detail TEXT NOT NULL,
    payload BLOB NOT NULL, payload_size INTEGER NOT NULL
);
CREATE TABLE ingest_recent (
    seq INTEGER PRIMARY KEY, mqtt_topic TEXT NOT NULL, device_seq INTEGER NOT NULL, crc INTEGER NOT NULL
);
CREATE TABLE drops (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
PRAGMA user_version=1;
"""

ROWS = [  # seq, route_id, pkey, mqtt_topic, flags, received_us, device_seq, payload
    (
        seq,
        1 + seq % 2,
        f"dev{seq % 3}",
        f"edge/dev{seq % 3}/up/{'env' if seq % 2 else 'ev'}",
        1 | (seq % 2) << 2,
        1_700_000_000_000_000 + seq,
        seq if seq % 4 else None,
        b'{"seq":%d}' % seq,
    )
    for seq in range(1, 301)
    if seq % 7  # gaps: rows already forwarded
]


def make_v1_file(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(V1_SCHEMA)
    conn.execute("INSERT INTO meta(key, value) VALUES ('epoch', '12345')")
    conn.executemany(
        "INSERT INTO routes(id, stream, topic) VALUES (?, ?, ?)",
        [(1, "edge", "telemetry"), (2, "edge", "events")],
    )
    conn.executemany("INSERT INTO outbox VALUES (?, ?, ?, ?, ?, ?, ?, ?)", ROWS)
    # seqs handed out up to 350 (the newest were forwarded and deleted)
    conn.execute("UPDATE sqlite_sequence SET seq = 350 WHERE name = 'outbox'")
    conn.execute(
        "INSERT INTO ingest_recent VALUES (?, ?, ?, ?)",
        (299, "edge/dev2/up/env", 299, zlib.crc32(b'{"seq":299}')),
    )
    conn.execute(
        "INSERT INTO dead_letters(received_us, mqtt_topic, qos, retain, reason, detail, payload,"
        " payload_size) VALUES (1, ?, 1, 0, 'unroutable', 'no route', x'00', 1)",
        (b"bad/topic",),
    )
    conn.execute("INSERT INTO drops(reason, count) VALUES ('ttl_expired', 4)")
    conn.close()


async def test_a_version_1_file_opens_with_every_record_id_and_counter(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    make_v1_file(path)
    # The CLI reads the old file before the agent migrated it (read only).
    assert read_stats(path).records == len(ROWS)
    assert [r.seq for r in iter_records(path)] == [r[0] for r in ROWS]
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 1

    box = await Outbox.open(path, BufferSettings(commit_interval_ms=0), GW, Metrics())
    box.start()
    try:
        assert box.records == len(ROWS)
        assert box.bytes == sum(len(r[7]) + len(r[3]) + ROW_OVERHEAD for r in ROWS)
        got = await box.read_batch(BIG, BIG)
        assert [r.seq for r in got] == [r[0] for r in ROWS], "every record, in order"
        assert all(r.message_id & (2**64 - 1) == r.seq for r in got)
        assert {r.message_id >> 64 & 0xFFFFFFFF for r in got} == {12345}, "the epoch, so the same ids"
        names = {1: ("edge", "telemetry"), 2: ("edge", "events")}
        for want, r in zip(ROWS, got, strict=True):
            _seq, rid, pkey, topic, flags, recv, dseq, payload = want
            assert r.headers[HEADER_RECEIVED_US] == str(recv)
            assert (r.stream, r.topic) == names[rid]
            assert (r.key, r.payload, r.headers[HEADER_MQTT_TOPIC]) == (pkey, payload, topic)
            assert r.headers[HEADER_QOS] == str(flags & 3)
            assert r.headers[HEADER_RETAIN] == ("1" if flags & 4 else "0")
            assert r.headers.get(HEADER_DEVICE_SEQ) == (None if dseq is None else str(dseq))
        assert box.seen("edge/dev2/up/env", 299, zlib.crc32(b'{"seq":299}')), "the redelivery window too"
        # A new record continues after the highest seq ever handed out.
        await box.submit(
            Incoming(Route("edge", "telemetry", "dev9"), "edge/dev9/up/env", 1, False, 5, b"new", 1)
        )
        (new,) = await box.read_batch(10, BIG, after=got[-1].seq)
        assert new.seq == 351
        assert await box.confirm(got[:10]) == 10
    finally:
        await box.close()
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 2
        assert c.execute("SELECT count(*) FROM dead_letters").fetchone()[0] == 1
        assert c.execute("SELECT count FROM drops WHERE reason = 'ttl_expired'").fetchone()[0] == 4
        assert "mqtt_topic" not in {r[1] for r in c.execute("PRAGMA table_info(outbox)")}
    stats = read_stats(path)
    assert stats.records == len(ROWS) - 10 + 1
    # and it opens again as version 2
    box = await Outbox.open(path, BufferSettings(commit_interval_ms=0), GW, Metrics())
    try:
        assert box.records == len(ROWS) - 10 + 1
    finally:
        await box.close()


async def test_a_file_from_a_newer_agent_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    make_v1_file(path)
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA user_version=99")
    before = path.read_bytes()
    with pytest.raises(StoreError, match="schema version 99"):
        await Outbox.open(path, BufferSettings(), GW, Metrics())
    assert path.read_bytes() == before


async def test_sources_nothing_refers_to_are_forgotten_once_the_outbox_empties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "SOURCES_KEPT", 5)
    path = tmp_path / "buffer.db"
    box = await Outbox.open(path, BufferSettings(commit_interval_ms=0), GW, Metrics())
    box.start()
    try:
        for i in range(20):
            await box.submit(Incoming(Route("edge", "t", f"d{i}"), f"edge/d{i}/up/x", 1, False, i, b"x", i))
        batch = await box.read_batch(BIG, BIG)
        assert await box.confirm(batch[:19]) == 19
        with sqlite3.connect(path) as c:
            assert c.execute("SELECT count(*) FROM sources").fetchone()[0] == 20
        assert await box.confirm(batch[19:]) == 1
        with sqlite3.connect(path) as c:
            assert c.execute("SELECT count(*) FROM sources").fetchone()[0] == 0
        await box.submit(Incoming(Route("edge", "t", "d0"), "edge/d0/up/x", 1, False, 1, b"again", 1))
        (again,) = await box.read_batch(BIG, BIG)
        assert (again.key, again.payload) == ("d0", b"again")
    finally:
        await box.close()
