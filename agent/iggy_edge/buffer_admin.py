"""Tools on the buffer file for the CLI, a separate process from the agent.

Reading (stats, peek, export, dead letters) works beside a running agent
(WAL); writing (purge, dead-letter replay) takes the file exclusively.  The
outbox itself, its schema, its connections and its design note are in the
store package; `exclusive` and `BufferBusy` live in store/db.py.
"""

from __future__ import annotations

import base64
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import BufferSettings
from .routing import Rejected, Router
from .store.db import BufferBusy, NoDatabase, StoreError, exclusive, ro_connect, sync_transaction
from .store.recovery import Event, acknowledge, read_events
from .store.schema import (
    COUNT_DROP_SQL,
    DEAD_TOTALS_SQL,
    OUTBOX_TOTALS_SQL,
    ROW_OVERHEAD,
    accounted_bytes,
    add_v1_view,
    device_seq_of,
    migrate,
)
from .store.sources import Catalog

__all__ = [
    "BufferBusy",
    "BufferStats",
    "DeadLetter",
    "ReplayResult",
    "StoredRecord",
    "ack_salvage",
    "count_rows",
    "exclusive",
    "iter_records",
    "purge",
    "read_dead_letters",
    "read_stats",
    "replay_dead_letters",
]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    received_us: int
    mqtt_topic: bytes
    qos: int
    retain: bool
    reason: str
    detail: str
    payload: bytes
    payload_size: int


@dataclass(frozen=True, slots=True)
class BufferStats:
    records: int
    bytes: int
    oldest_received_us: int | None
    newest_seq: int | None
    dead_letters: int
    dead_letters_by_reason: dict[str, int]
    drops_by_reason: dict[str, int]
    file_bytes: int
    dead_letter_bytes: int = 0  # accounted (payload + topic + ROW_OVERHEAD), against max_dead_letter_bytes
    recovery: list[Event] = field(default_factory=list)  # damaged buffer / WAL events (store/recovery/)

    @property
    def unacknowledged(self) -> list[Event]:
        return [e for e in self.recovery if not e.acknowledged]

    def as_dict(self) -> dict[str, Any]:
        age = None if self.oldest_received_us is None else time.time() - self.oldest_received_us / 1e6
        return {
            "records": self.records,
            "bytes": self.bytes,
            "oldest_age_s": None if age is None else round(age, 3),
            "newest_seq": self.newest_seq,
            "dead_letters": self.dead_letters,
            "dead_letters_by_reason": self.dead_letters_by_reason,
            "dead_letter_bytes": self.dead_letter_bytes,
            "drops_by_reason": self.drops_by_reason,
            "file_bytes": self.file_bytes,
            "recovery": [asdict(e) for e in self.recovery],
        }


# -- read-only helpers for the CLI (a separate process, WAL lets it read) --


def _reader(path: Path) -> sqlite3.Connection:
    """A read-only connection with `outbox_rows` also on a file the agent
    has not migrated yet (schema.add_v1_view)."""
    conn = ro_connect(path)
    try:
        created = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'outbox'").fetchone() is not None
        if created:
            add_v1_view(conn)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise StoreError(f"{path}: {e}") from e
    if not created:
        # The agent creates the file, then its tables: a reader in between.
        conn.close()
        raise NoDatabase(f"{path}: no buffer tables yet (the agent is creating them; try again)")
    return conn


def read_stats(path: Path) -> BufferStats:
    conn = _reader(path)
    try:
        records, nbytes = conn.execute(OUTBOX_TOTALS_SQL).fetchone()
        oldest = conn.execute("SELECT received_us FROM outbox ORDER BY seq LIMIT 1").fetchone()
        newest = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
        by_reason = dict(conn.execute("SELECT reason, count(*) FROM dead_letters GROUP BY reason").fetchall())
        drops = dict(conn.execute("SELECT reason, count FROM drops").fetchall())
        dead_count, dead_bytes = conn.execute(DEAD_TOTALS_SQL).fetchone()
        recovery = read_events(conn)
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: {e}") from e
    finally:
        conn.close()
    file_bytes = sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())
    return BufferStats(
        records=int(records),
        bytes=int(nbytes) + ROW_OVERHEAD * int(records),
        oldest_received_us=None if oldest is None else int(oldest[0]),
        newest_seq=None if newest is None else int(newest[0]),
        dead_letters=sum(by_reason.values()),
        dead_letters_by_reason={str(k): int(v) for k, v in by_reason.items()},
        drops_by_reason={str(k): int(v) for k, v in drops.items()},
        file_bytes=file_bytes,
        dead_letter_bytes=int(dead_bytes) + ROW_OVERHEAD * int(dead_count),
        recovery=recovery,
    )


def read_dead_letters(path: Path, limit: int = 100) -> list[DeadLetter]:
    conn = _reader(path)
    try:
        rows = conn.execute(
            "SELECT id, received_us, mqtt_topic, qos, retain, reason, detail, payload, payload_size"
            " FROM dead_letters ORDER BY id DESC LIMIT ?",
            (limit,),
        ).fetchall()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: {e}") from e
    finally:
        conn.close()
    return [
        DeadLetter(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5], r[6], bytes(r[7]), r[8]) for r in rows
    ]


# -- maintenance helpers for the CLI: peek, export, purge, dead-letter replay --
#
# Reading (peek, export) works beside a running agent: short read
# transactions on a read-only connection, paged by seq, so the WAL can still
# be checkpointed.  Writing (purge, replay) must not race the agent, whose
# record and byte counters live in memory: `exclusive()` opens the file with
# `locking_mode=EXCLUSIVE` and no busy timeout.  In WAL mode every open
# connection holds a shared lock, so the exclusive lock is refused while the
# agent (or any other reader) has the file open -- `BufferBusy` -- and, the
# other way round, an agent that starts during a purge waits its busy timeout
# (5 s) and then fails to open the buffer; systemd restarts it after
# RestartSec.  Stop the service for maintenance.


@dataclass(frozen=True, slots=True)
class StoredRecord:
    seq: int
    stream: str
    topic: str
    key: str
    mqtt_topic: str
    qos: int
    retain: bool
    received_us: int
    device_seq: int | None
    payload: bytes

    def as_json(self) -> dict[str, Any]:
        """JSON-safe form: `payload` as text when it is UTF-8, else `payload_b64`."""
        doc: dict[str, Any] = {
            "seq": self.seq,
            "stream": self.stream,
            "topic": self.topic,
            "key": self.key,
            "mqtt_topic": self.mqtt_topic,
            "qos": self.qos,
            "retain": self.retain,
            "received_us": self.received_us,
            "device_seq": self.device_seq,
        }
        try:
            doc["payload"] = self.payload.decode("utf-8")
        except UnicodeDecodeError:
            doc["payload_b64"] = base64.b64encode(self.payload).decode("ascii")
        return doc


def iter_records(path: Path, *, limit: int | None = None, chunk: int = 1000) -> Iterator[StoredRecord]:
    """Outbox records oldest first (seq order), read in pages of `chunk`."""
    conn = _reader(path)
    try:
        routes = {
            int(r[0]): (str(r[1]), str(r[2])) for r in conn.execute("SELECT id, stream, topic FROM routes")
        }
        after, left = 0, limit
        while left is None or left > 0:
            n = chunk if left is None else min(chunk, left)
            rows = conn.execute(
                "SELECT seq, route_id, pkey, mqtt_topic, flags, received_us, device_seq, payload"
                " FROM outbox_rows WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, n),
            ).fetchall()
            if not rows:
                return
            for seq, rid, pkey, topic, flags, recv, dseq, payload in rows:
                stream, itopic = routes.get(rid, ("?", "?"))
                yield StoredRecord(
                    seq, stream, itopic, pkey, topic, flags & 3, bool(flags & 4), recv, dseq, bytes(payload)
                )
            after = int(rows[-1][0])
            if left is not None:
                left -= len(rows)
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: {e}") from e
    finally:
        conn.close()


def purge(
    conn: sqlite3.Connection,
    *,
    dead_letters: bool = False,
    chunk: int = 5000,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, int]:
    """Delete every outbox record (counted under drops reason "purged") and,
    with `dead_letters`, every dead letter; chunked, one transaction per
    chunk, so an interrupted purge keeps what it has not reached yet.
    Returns (records, dead letters) deleted."""
    records = 0
    while True:
        with sync_transaction(conn):
            n = conn.execute(
                "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox ORDER BY seq LIMIT ?)", (chunk,)
            ).rowcount
            if n:
                conn.execute(COUNT_DROP_SQL, ("purged", n))
        if not n:
            break
        records += n
        if progress is not None:
            progress(n)
    dead = 0
    if dead_letters:
        with sync_transaction(conn):
            dead = conn.execute("DELETE FROM dead_letters").rowcount
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return records, dead


@dataclass
class ReplayResult:
    replayed: int = 0
    still_dead: dict[str, int] = field(default_factory=dict)  # reason -> count, left in place
    no_room: int = 0  # routable but the outbox is at max_records / max_bytes

    def keep(self, reason: str) -> None:
        self.still_dead[reason] = self.still_dead.get(reason, 0) + 1


def replay_dead_letters(
    conn: sqlite3.Connection,
    router: Router,
    settings: BufferSettings,
    *,
    chunk: int = 500,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Route every dead letter again with the current rules; those that now
    route go to the outbox (with their original receive time, in their
    original order) and leave the dead-letter table, in one transaction per
    chunk.  Those that still do not route stay, by reason.  A payload that
    was truncated when it was dead-lettered is never replayed."""
    result = ReplayResult()
    migrate(conn)  # a file the agent has not opened since its upgrade
    count, nbytes = conn.execute(OUTBOX_TOTALS_SQL).fetchone()
    records, used = int(count), int(nbytes) + ROW_OVERHEAD * int(count)
    catalog = Catalog()
    after = 0
    while True:
        rows = conn.execute(
            "SELECT id, received_us, mqtt_topic, qos, retain, payload, payload_size FROM dead_letters"
            " WHERE id > ? ORDER BY id LIMIT ?",
            (after, chunk),
        ).fetchall()
        if not rows:
            break
        after = int(rows[-1][0])
        with sync_transaction(conn):
            for dl_id, recv, topic_b, qos, retain, payload_b, size in rows:
                payload = bytes(payload_b)
                try:
                    topic_or_b: str | bytes = bytes(topic_b).decode("utf-8")
                except UnicodeDecodeError:
                    topic_or_b = bytes(topic_b)  # the router rejects it as invalid_topic
                route = router.route(topic_or_b, int(size))
                if isinstance(route, Rejected):
                    result.keep(route.reason.value)
                    continue
                if len(payload) != size:
                    result.keep("truncated")
                    continue
                assert isinstance(topic_or_b, str)  # a bytes topic never routes
                topic = topic_or_b
                add = accounted_bytes(len(payload), topic)
                if records + 1 > settings.max_records or used + add > settings.max_bytes:
                    result.no_room += 1
                    continue
                rid = catalog.route_id_sync(conn, route.stream, route.topic)
                conn.execute(
                    "INSERT INTO outbox(source_id, flags, received_us, device_seq, payload)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (
                        catalog.source_id_sync(conn, (rid, route.key, topic)),
                        int(qos) | (int(retain) << 2),
                        recv,
                        device_seq_of(payload),
                        payload,
                    ),
                )
                conn.execute("DELETE FROM dead_letters WHERE id = ?", (dl_id,))
                records += 1
                used += add
                result.replayed += 1
        if progress is not None:
            progress(len(rows))
    return result


def ack_salvage(path: Path) -> int:
    """Acknowledge the recovery events (a damaged buffer moved aside and
    salvaged, a damaged WAL copied aside): health stops showing them.  Works
    beside the running agent (a short write transaction; it re-reads the
    events every few seconds).  Returns how many were open."""
    if not path.exists():
        raise NoDatabase(f"{path}: no buffer database (has the agent run yet?)")
    conn = sqlite3.connect(path, isolation_level=None, timeout=10)
    try:
        return acknowledge(conn)
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: {e}") from e
    finally:
        conn.close()


def count_rows(path: Path, table: str) -> int:
    """Rows in `outbox` or `dead_letters` (for progress bars)."""
    if table not in ("outbox", "dead_letters"):
        raise ValueError(table)
    conn = _reader(path)
    try:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # noqa: S608 - fixed names
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: {e}") from e
    finally:
        conn.close()
