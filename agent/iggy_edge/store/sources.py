"""Routes and sources: the one place a route or a source gets its id.

A source is a (route id, partition key, MQTT topic), a row of `sources`
(schema.py); an outbox row names it by id.  Every writer of outbox rows --
the group commit (commit.py), the salvage of a damaged file
(recovery/salvage.py) and the CLI's dead-letter replay (buffer_admin.py) --
gets its ids from a `Catalog`: the cache in front of the two tables, and the
one "get or create" (`ROUTE_ID_SQL`, `SOURCE_ID_SQL`: an upsert that returns
the id of the existing row or of the one it creates, one round trip either
way).

The lookup is written once, without I/O (`_route_id`, `_source_ids`:
generators that yield the statement for a miss and are sent its id back);
`_run` drives them on the agent's aiosqlite connection, `_run_sync` on a
blocking one.  The agent caches new sources only after their transaction
committed (`add`; a rollback must not leave an id in the cache); the
blocking users cache them at once (an error aborts their whole run).
Sources no row refers to are deleted (`ORPHANS_SQL`) when the outbox opens
and when a device's bound needs their room (devices.py).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Generator, Iterable
from typing import Any, Final, TypeVar

from .db import Database

ROUTE_ID_SQL: Final = (
    "INSERT INTO routes(stream, topic) VALUES (?, ?)"
    " ON CONFLICT(stream, topic) DO UPDATE SET topic = excluded.topic RETURNING id"
)
SOURCE_ID_SQL: Final = (
    "INSERT INTO sources(route_id, pkey, mqtt_topic) VALUES (?, ?, ?)"
    " ON CONFLICT(route_id, pkey, mqtt_topic) DO UPDATE SET pkey = excluded.pkey RETURNING id"
)
# Sources without a row (the index outbox_by_source makes each probe a lookup).
ORPHANS_SQL: Final = (
    "DELETE FROM sources WHERE NOT EXISTS (SELECT 1 FROM outbox WHERE source_id = sources.id)"
)

T = TypeVar("T")
SourceKey = tuple[int, str, str]  # (route id, partition key, MQTT topic)
# Yields (statement, parameters) for each id it does not know, is sent the id.
Lookup = Generator[tuple[str, tuple[Any, ...]], int, T]


async def _run(db: Database, lookup: Lookup[T]) -> T:
    """Drive a lookup on the agent's connection (caller holds the lock)."""
    try:
        step = next(lookup)
        while True:
            row = await db.fetchone(*step)
            step = lookup.send(int(row[0]))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _run_sync(conn: sqlite3.Connection, lookup: Lookup[T]) -> T:
    """Drive a lookup on a blocking connection."""
    try:
        step = next(lookup)
        while True:
            (value,) = conn.execute(*step).fetchone()
            step = lookup.send(int(value))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


class Catalog:
    """The ids of one buffer file's routes and sources, cached both ways."""

    def __init__(self) -> None:
        self.route_ids: dict[tuple[str, str], int] = {}
        self.route_names: dict[int, tuple[str, str]] = {}
        # (route id, key, mqtt topic) -> id, and id -> (stream, topic, key,
        # mqtt topic) for the reader
        self.source_ids: dict[SourceKey, int] = {}
        self.source_names: dict[int, tuple[str, str, str, str]] = {}

    # -- the one lookup ------------------------------------------------------

    def _route_id(self, stream: str, topic: str) -> Lookup[int]:
        key = (stream, topic)
        rid = self.route_ids.get(key)
        if rid is None:
            rid = yield ROUTE_ID_SQL, key
            self.add_route(rid, stream, topic)
        return rid

    def _source_ids(self, keys: Iterable[SourceKey], new: dict[SourceKey, int]) -> Lookup[list[int]]:
        """The id of each key: cached, or in `new` (created by this caller
        and not cached yet), or created now (and put in `new`)."""
        known = self.source_ids
        out = []
        for key in keys:
            sid = known.get(key) or new.get(key)
            if sid is None:
                sid = new[key] = yield SOURCE_ID_SQL, key
            out.append(sid)
        return out

    # -- the agent's side -----------------------------------------------------

    async def route_id(self, db: Database, stream: str, topic: str) -> int:
        """The id of a route (created and cached when new; autocommit)."""
        return await _run(db, self._route_id(stream, topic))

    async def source_rows(
        self, db: Database, rows: list[tuple[Any, ...]]
    ) -> tuple[list[tuple[Any, ...]], dict[SourceKey, int]]:
        """Rows (route_id, pkey, mqtt_topic, flags, received_us, device_seq,
        payload) as outbox rows (source_id, flags, received_us, device_seq,
        payload).  Sources new to the file are created inside the caller's
        transaction and returned, for `add` once it committed."""
        new: dict[SourceKey, int] = {}
        sids = await _run(db, self._source_ids([(r[0], r[1], r[2]) for r in rows], new))
        return [(sid, r[3], r[4], r[5], r[6]) for sid, r in zip(sids, rows, strict=True)], new

    def add_route(self, rid: int, stream: str, topic: str) -> None:
        self.route_ids[(stream, topic)] = rid
        self.route_names[rid] = (stream, topic)

    def add(self, sid: int, key: SourceKey) -> None:
        """Cache a source (committed)."""
        self.source_ids[key] = sid
        stream, topic = self.route_names[key[0]]
        self.source_names[sid] = (stream, topic, key[1], key[2])

    def forget(self, sid: int) -> tuple[str, str, str, str]:
        """Drop a source from the cache; its (stream, topic, key, mqtt topic)."""
        names = self.source_names.pop(sid)
        stream, itopic, key, topic = names
        self.source_ids.pop((self.route_ids[(stream, itopic)], key, topic), None)
        return names

    # -- blocking users (salvage, the CLI's replay) -----------------------------

    def route_id_sync(self, conn: sqlite3.Connection, stream: str, topic: str) -> int:
        return _run_sync(conn, self._route_id(stream, topic))

    def source_id_sync(self, conn: sqlite3.Connection, key: SourceKey) -> int:
        """The id of a source (created when new, cached at once)."""
        return _run_sync(conn, self._source_ids([key], self.source_ids))[0]
