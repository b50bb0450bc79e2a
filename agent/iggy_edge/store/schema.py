"""Schema and migrations of the buffer file, its constants, and opening it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
from pathlib import Path
from typing import Final

from .db import Database

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 2
ROW_OVERHEAD: Final = 48  # accounted bytes per row besides payload and topic
RECENT_WINDOW: Final = 20_000
RECENT_TRIM: Final = 1000  # ingest_recent is trimmed back to the window once this many more
ROWS_PER_INSERT: Final = 128  # x 7 columns stays far below SQLite's 32766 bound variables
BUSY_TIMEOUT_MS: Final = 5000
DEVICE_SEQ = re.compile(rb'"seq"\s*:\s*(\d{1,19})')

# Version 2 (issue 14, disk per record): an outbox row names its source
# (route, partition key, MQTT topic: the same for every reading of one
# device channel) by a small integer instead of carrying the two strings and
# the route id, 23 of the 129 bytes a 60-byte record took.  Readers that
# want the old shape use the view `outbox_rows`.  `migrate` converts a
# version 1 file in place, ids and order kept.
SOURCES_TABLE: Final = """
CREATE TABLE IF NOT EXISTS sources (
    id INTEGER PRIMARY KEY,
    route_id INTEGER NOT NULL,
    pkey TEXT NOT NULL,
    mqtt_topic TEXT NOT NULL,
    UNIQUE (route_id, pkey, mqtt_topic)
)"""
OUTBOX_TABLE: Final = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    source_id INTEGER NOT NULL,      -- sources.id
    flags INTEGER NOT NULL,          -- qos | retain << 2
    received_us INTEGER NOT NULL,
    device_seq INTEGER,
    payload BLOB NOT NULL
)"""
# The version 1 shape of an outbox row, for readers (CLI, salvage, bounds).
OUTBOX_ROWS_VIEW: Final = """
CREATE VIEW IF NOT EXISTS outbox_rows AS
    SELECT o.seq AS seq, s.route_id AS route_id, s.pkey AS pkey, s.mqtt_topic AS mqtt_topic,
           o.flags AS flags, o.received_us AS received_us, o.device_seq AS device_seq, o.payload AS payload
    FROM outbox AS o JOIN sources AS s ON s.id = o.source_id"""
# The same view over a version 1 file, for a read-only connection (a TEMP
# view: the file itself is not touched; the agent migrates it when it opens).
OUTBOX_ROWS_VIEW_V1: Final = """
CREATE TEMP VIEW IF NOT EXISTS outbox_rows AS
    SELECT seq, route_id, pkey, mqtt_topic, flags, received_us, device_seq, payload FROM main.outbox"""

SCHEMA: Final = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS routes (
    id INTEGER PRIMARY KEY,
    stream TEXT NOT NULL,
    topic TEXT NOT NULL,
    UNIQUE (stream, topic)
);
{SOURCES_TABLE};
{OUTBOX_TABLE};
{OUTBOX_ROWS_VIEW};
-- A device's oldest rows (fair drop_oldest, store/bounds.py) and a source's
-- orphan check (store/sources.py) without a scan.  Not a schema change: an
-- older agent opens a file with it as before.
CREATE INDEX IF NOT EXISTS outbox_by_source ON outbox(source_id);
CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    received_us INTEGER NOT NULL,
    mqtt_topic BLOB NOT NULL,        -- bytes: the topic may not be UTF-8
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    reason TEXT NOT NULL,
    detail TEXT NOT NULL,
    payload BLOB NOT NULL,           -- truncated to max_payload_bytes
    payload_size INTEGER NOT NULL    -- the original size
);
-- Recently committed (topic, device seq, payload crc) -> seq, so a message the
-- broker redelivers after we died between commit and PUBACK is recognised.
CREATE TABLE IF NOT EXISTS ingest_recent (
    seq INTEGER PRIMARY KEY,
    mqtt_topic TEXT NOT NULL,
    device_seq INTEGER NOT NULL,
    crc INTEGER NOT NULL
);
-- Drops by reason, kept with the data so `buffer stats` can show them while
-- the agent is stopped (the live counters are in metrics).
CREATE TABLE IF NOT EXISTS drops (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
"""
# Row count and accounted bytes (payload + topic, without ROW_OVERHEAD).
OUTBOX_TOTALS_SQL: Final = (
    "SELECT count(*), coalesce(sum(length(payload) + length(mqtt_topic)), 0) FROM outbox_rows"
)
# At open: the totals and the largest payload (the outbox's `payload_high`).
OUTBOX_LOAD_SQL: Final = (
    "SELECT count(*), coalesce(sum(length(payload) + length(mqtt_topic)), 0),"
    " coalesce(max(length(payload)), 0) FROM outbox_rows"
)
# Dead letters: count and accounted bytes without ROW_OVERHEAD (dead.py).
DEAD_TOTALS_SQL: Final = (
    "SELECT count(*), coalesce(sum(length(payload) + length(mqtt_topic)), 0) FROM dead_letters"
)
COUNT_DROP_SQL: Final = (
    "INSERT INTO drops(reason, count) VALUES (?, ?)"
    " ON CONFLICT(reason) DO UPDATE SET count = count + excluded.count"
)


def device_seq_of(payload: bytes) -> int | None:
    """The device's own sequence number when the payload carries `"seq": N`."""
    if payload[:1] != b"{":  # (a one-byte slice is a cached object: cheaper than startswith)
        return None
    m = DEVICE_SEQ.search(payload, 0, 256)
    return int(m[1]) if m else None


def accounted_bytes(payload_len: int, topic: str) -> int:
    """Bytes a row counts against `max_bytes`."""
    return payload_len + len(topic) + ROW_OVERHEAD


def file_version(conn: sqlite3.Connection) -> int:
    """The schema version of an open buffer file: 0 for a new (empty) one.
    A file from before user_version was kept has the version 1 tables."""
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version:
        return int(version)
    cols = {r[1] for r in conn.execute("PRAGMA table_info(outbox)")}
    return 1 if "mqtt_topic" in cols else 0


def add_v1_view(conn: sqlite3.Connection) -> None:
    """On a read-only connection to a version 1 file: the `outbox_rows`
    view as a TEMP view, so the CLI reads old files before the agent
    migrated them."""
    if file_version(conn) == 1:
        conn.execute(OUTBOX_ROWS_VIEW_V1)


class NewerSchema(sqlite3.DatabaseError):
    """The file was written by a newer agent (a schema this one does not know)."""


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the buffer file on `conn` (isolation_level None) to
    SCHEMA_VERSION in place and return the version it had.  Version 1 -> 2
    is one transaction, so a failure (a full disk) leaves the file as it
    was: sources from the distinct (route, key, topic) of the rows, every
    row copied with its seq, the AUTOINCREMENT counter carried over (seqs,
    hence message ids, are never reused: records.py)."""
    version = file_version(conn)
    if version > SCHEMA_VERSION:
        raise NewerSchema(
            f"buffer file has schema version {version}; this agent knows up to {SCHEMA_VERSION}"
        )
    if version == 1:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("ALTER TABLE outbox RENAME TO outbox_v1")  # its sqlite_sequence entry moves along
            conn.execute(SOURCES_TABLE)
            conn.execute(OUTBOX_TABLE)
            conn.execute(
                "INSERT OR IGNORE INTO sources(route_id, pkey, mqtt_topic)"
                " SELECT route_id, pkey, mqtt_topic FROM outbox_v1 ORDER BY seq"
            )
            conn.execute(
                "INSERT INTO outbox(seq, source_id, flags, received_us, device_seq, payload)"
                " SELECT o.seq, s.id, o.flags, o.received_us, o.device_seq, o.payload"
                " FROM outbox_v1 AS o JOIN sources AS s"
                " ON s.route_id = o.route_id AND s.pkey = o.pkey AND s.mqtt_topic = o.mqtt_topic"
                " ORDER BY o.seq"
            )
            conn.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
            conn.execute(
                "INSERT INTO sqlite_sequence(name, seq)"
                " SELECT 'outbox', seq FROM sqlite_sequence WHERE name = 'outbox_v1'"
            )
            conn.execute("DROP TABLE outbox_v1")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        log.warning(
            "buffer file migrated from schema version 1 to %d (records, ids and order kept)", SCHEMA_VERSION
        )
    conn.executescript(SCHEMA)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    return version


def prepare_file(path: Path) -> int:
    """Create or migrate the buffer file (blocking; before the agent's
    connection opens it).  Returns the version the file had."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        return migrate(conn)
    finally:
        conn.close()


async def open_file(path: Path) -> Database:
    """Create or migrate the file, then open the agent's connection to it and
    read the outbox once (a damaged file often fails here).  Recovery, when
    it fails, is the caller's (recovery/opening.py)."""
    await asyncio.to_thread(prepare_file, path)
    db = await Database.connect(path, busy_timeout_ms=BUSY_TIMEOUT_MS)
    try:
        async with db.conn.execute("SELECT count(*) FROM outbox"):
            pass
    except BaseException:
        await db.close()
        raise
    return db
