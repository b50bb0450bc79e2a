"""Recovery events: kept in the meta table (key ``recovery``, a JSON list)
until an operator acknowledges them (``iggy-edge buffer ack-salvage``)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import asdict, dataclass

from ..db import Database, sync_transaction


@dataclass
class Event:
    """A recovery event, kept in meta until an operator acknowledges it."""

    kind: str  # "salvaged" | "wal_damaged"
    at: float
    detail: str
    aside: str = ""  # the moved or copied file
    salvaged: int = 0
    unreadable: int = 0
    dead_letters: int = 0
    frames_lost: int = 0
    acknowledged: bool = False


def events_from_json(text: str | None) -> list[Event]:
    if not text:
        return []
    try:
        return [Event(**d) for d in json.loads(text)]
    except (ValueError, TypeError):
        return []


def events_to_json(events: list[Event]) -> str:
    return json.dumps([asdict(e) for e in events])


def read_events(conn: sqlite3.Connection) -> list[Event]:
    row = conn.execute("SELECT value FROM meta WHERE key = 'recovery'").fetchone()
    return events_from_json(None if row is None else str(row[0]))


def acknowledge(conn: sqlite3.Connection) -> int:
    """Mark every recovery event acknowledged; returns how many were open."""
    with sync_transaction(conn):
        events = read_events(conn)
        fresh = [e for e in events if not e.acknowledged]
        for e in events:
            e.acknowledged = True
        conn.execute(
            "INSERT OR REPLACE INTO meta(key, value) VALUES ('recovery', ?)", (events_to_json(events),)
        )
    return len(fresh)


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
