"""Schema and migrations of the buffer file, its constants, and opening it."""

from __future__ import annotations

import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Final

from ..metrics import Metrics
from .db import Database, StoreError

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
    """Open (creating) the buffer database; move an unreadable one aside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return await _open(path)
    except sqlite3.DatabaseError as e:
        if "locked" in str(e):
            raise StoreError(f"{path}: database is locked by another process") from e
        aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
        log.error(
            "buffer database %s is unreadable (%s): moved aside to %s and starting a fresh one; "
            "records in it were NOT forwarded",
            path,
            e,
            aside,
        )
        if metrics is not None:
            metrics.store_errors.inc()
        path.rename(aside)
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.exists():
                side.rename(aside.with_name(aside.name + suffix))
        return await _open(path)
