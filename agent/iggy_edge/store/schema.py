"""Schema and migrations of the buffer file, its constants, and opening it."""

from __future__ import annotations

import asyncio
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

SCHEMA_VERSION: Final = 1
ROW_OVERHEAD: Final = 48  # accounted bytes per row besides payload and topic
RECENT_WINDOW: Final = 20_000
ROWS_PER_INSERT: Final = 128  # x 7 columns stays far below SQLite's 32766 bound variables
BUSY_TIMEOUT_MS: Final = 5000
DEVICE_SEQ = re.compile(rb'"seq"\s*:\s*(\d{1,19})')

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS routes (
    id INTEGER PRIMARY KEY,
    stream TEXT NOT NULL,
    topic TEXT NOT NULL,
    UNIQUE (stream, topic)
);
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    route_id INTEGER NOT NULL,
    pkey TEXT NOT NULL,
    mqtt_topic TEXT NOT NULL,
    flags INTEGER NOT NULL,          -- qos | retain << 2
    received_us INTEGER NOT NULL,
    device_seq INTEGER,
    payload BLOB NOT NULL
);
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


async def _open(path: Path) -> Database:
    db = await Database.connect(path, busy_timeout_ms=BUSY_TIMEOUT_MS, schema=SCHEMA)
    try:
        await db.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
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
