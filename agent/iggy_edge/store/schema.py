"""Schema and migrations of the buffer file, its constants, and opening it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Final

from ..metrics import Metrics
from .db import Database
from .recovery import (
    Event,
    StoreUnavailable,
    as_store_error,
    check_wal,
    events_from_json,
    events_to_json,
    integrity_problem,
    is_corruption,
    move_aside,
    salvage,
)

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
    if not payload.startswith(b"{"):
        return None
    m = DEVICE_SEQ.search(payload, 0, 256)
    return int(m.group(1)) if m else None


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


async def _open(path: Path) -> Database:
    await asyncio.to_thread(prepare_file, path)
    db = await Database.connect(path, busy_timeout_ms=BUSY_TIMEOUT_MS)
    try:
        async with db.conn.execute("SELECT count(*) FROM outbox"):
            pass
    except BaseException:
        await db.close()
        raise
    return db


async def open_database(path: Path, metrics: Metrics | None = None) -> Database:
    """Open (creating) the buffer database.  A damaged WAL header is copied
    aside first; a confirmed corruption moves the file aside and salvages it
    into a fresh one; any other failure leaves the file in place and raises
    (`StoreUnavailable`, or `StoreError` "locked").  See recovery.py."""
    events: list[Event] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        wal = check_wal(path)
    except OSError as e:
        raise StoreUnavailable(f"{path}: {e}; the file is left in place") from e
    if wal is not None:
        events.append(wal)
        if metrics is not None:
            metrics.store_wal_damaged.inc()
            metrics.store_wal_frames_lost.inc(wal.frames_lost)
    return await reopen(path, metrics, events)


async def reopen(
    path: Path, metrics: Metrics | None, events: list[Event], *, recovered: bool = False
) -> Database:
    """`_open`, salvaging once on a confirmed corruption; records `events`."""
    try:
        db = await _open(path)
    except (sqlite3.Error, OSError) as e:
        if metrics is not None:
            metrics.store_errors.inc()
        if not recovered and await recover(path, e, metrics, events):
            return await reopen(path, metrics, events, recovered=True)
        raise as_store_error(path, e) from e
    if events:
        try:
            await record_events(db, events)
        except BaseException:
            await db.close()
            raise
    return db


async def recover(path: Path, e: BaseException, metrics: Metrics | None, events: list[Event]) -> bool:
    """On a confirmed corruption: move the file aside, salvage it into a
    fresh one and return True.  Otherwise (not a corruption code, or
    integrity_check says ok, or the check itself hits the disk) False."""
    if not is_corruption(e):
        return False
    try:
        problem = await asyncio.to_thread(integrity_problem, path)
    except (sqlite3.Error, OSError) as check_error:
        log.error("buffer %s: %s, and checking it failed too (%s): leaving it in place", path, e, check_error)
        return False
    if problem is None:
        log.error("buffer %s: %s, but integrity_check is ok: leaving it in place", path, e)
        return False
    # Salvage into a new file beside it first and swap only when that worked:
    # a failure on the way (the disk is also full) leaves the damaged file in
    # place for the next attempt, never an empty buffer in its stead.
    now = time.time()
    tmp = path.with_name(path.name + ".salvage")
    log.error(
        "buffer database %s is damaged (%s; integrity_check: %s): salvaging what can be read"
        " into a fresh buffer",
        path,
        e,
        problem[:300],
    )
    try:
        for side in (tmp, *(tmp.with_name(tmp.name + x) for x in ("-wal", "-shm"))):
            side.unlink(missing_ok=True)
        fresh = await _open(tmp)
        await fresh.close()
        event = await asyncio.to_thread(salvage, path, tmp, now=now)
        aside = move_aside(path, now)
        for suffix in ("-wal", "-shm"):
            side = tmp.with_name(tmp.name + suffix)
            if side.exists():
                side.rename(path.with_name(path.name + suffix))
        tmp.rename(path)
    except (sqlite3.Error, OSError) as salvage_error:
        raise StoreUnavailable(
            f"{path}: salvage of the damaged buffer failed: {salvage_error}; the file is left in place"
        ) from salvage_error
    event.aside = str(aside)
    log.error(
        "salvaged %d records from %s into a fresh buffer (ids and order kept); %d unreadable, %d became dead "
        "letters (route unreadable); %s.  Acknowledge with: iggy-edge buffer ack-salvage",
        event.salvaged,
        aside,
        event.unreadable,
        event.dead_letters,
        event.detail,
    )
    if metrics is not None:
        metrics.store_moved_aside.inc()
        metrics.store_salvaged.inc(event.salvaged)
        metrics.store_unreadable.inc(event.unreadable)
    events.append(event)
    return True


async def record_events(db: Database, events: list[Event]) -> None:
    """Append recovery events to meta (shown until acknowledged)."""
    async with db.write() as conn:
        async with conn.execute("SELECT value FROM meta WHERE key = 'recovery'") as cur:
            row = await cur.fetchone()
        known = events_from_json(None if row is None else str(row[0]))
        await conn.execute(
            "INSERT OR REPLACE INTO meta(key, value) VALUES ('recovery', ?)",
            (events_to_json(known + events),),
        )
    events.clear()
