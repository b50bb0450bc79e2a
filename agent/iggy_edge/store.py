"""The outbox: a durable, bounded SQLite buffer between MQTT and Iggy.

Design
------
* One database file (WAL mode) holds the outbox, the dead letters and a small
  meta table; the return path keeps its inbox and offsets in the same file
  (its own tables, see downlink).  One aiosqlite connection serialises every
  statement of this process on one thread, so there is no lock contention
  inside the agent; other processes (the CLI) may read concurrently (WAL).
* **Group commit.**  Ingest hands records over synchronously
  (`Outbox.submit`) in arrival order and awaits the commit of the group that
  contains them.  A committer task takes whatever is pending (up to
  `commit_max_records`), waits at most `commit_interval_ms` for more,
  writes them in one transaction and resolves one future for the whole group.
  The MQTT acknowledgement is sent only after that future resolves, so an
  acknowledged QoS1 message is always on disk.
* **Durability.**  Inserts commit with `PRAGMA synchronous=FULL` by default:
  the WAL is fsynced at every commit, so a committed record survives power
  loss.  Deletes (after Iggy confirmed) commit with `synchronous=NORMAL`: a
  delete lost to a power cut only means the record is sent again, with the
  same message id, which consumers already de-duplicate.  `synchronous =
  "normal"` in the config trades power-loss safety of the last commits for
  speed (crash safety remains); bench/ingest_bench.py measures both.
* **Identity.**  `seq` is an AUTOINCREMENT key, so it is never reused, even
  after the outbox empties; the message id is (gateway hash, epoch, seq), see
  records.py.  Forwarding reads in seq order, which is arrival order, so per
  partition key order holds across outages and restarts.
* **Bounds.**  `max_records` and `max_bytes` (accounted bytes = payload +
  topic + a fixed per-row overhead) are enforced at insert time with the
  configured policy: `drop_oldest` deletes the oldest records, `reject_new`
  refuses the new ones.  Records older than `ttl_s` are expired.  Every drop
  is counted by reason and logged (rate-limited).  Dead letters are bounded
  by count, oldest first.
* **Corruption.**  A file SQLite cannot read is moved aside
  (`buffer.db.corrupt-<time>`) and a fresh buffer is started, loudly: a
  gateway must not crash-loop on a bad SD card sector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import sqlite3
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, Final

import aiosqlite

from .config import BufferSettings
from .logs import RateLimitedLog
from .metrics import Metrics
from .records import (
    HEADER_DEVICE_SEQ,
    HEADER_GATEWAY,
    HEADER_MQTT_TOPIC,
    HEADER_QOS,
    HEADER_RECEIVED_US,
    HEADER_RETAIN,
    OutboundRecord,
    Route,
    gateway_hash32,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 1
ROW_OVERHEAD: Final = 48  # accounted bytes per row besides payload and topic
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
RECENT_WINDOW: Final = 20_000
ROWS_PER_INSERT: Final = 128  # x 7 columns stays far below SQLite's 32766 bound variables


class StoreError(Exception):
    """The buffer cannot take or give records (disk full, I/O error)."""


@dataclass(slots=True)
class Incoming:
    """A message from ingest, waiting in the pending group."""

    route: Route
    mqtt_topic: str
    qos: int
    retain: bool
    received_us: int
    payload: bytes
    device_seq: int | None = None


@dataclass
class _Group:
    items: list[Incoming] = field(default_factory=list)
    done: asyncio.Future[None] | None = None


def device_seq_of(payload: bytes) -> int | None:
    """The device's own sequence number when the payload carries `"seq": N`."""
    if not payload.startswith(b"{"):
        return None
    m = DEVICE_SEQ.search(payload, 0, 256)
    return int(m.group(1)) if m else None


@lru_cache(maxsize=64)
def _values_sql(head: str, ncols: int, nrows: int) -> str:
    row = "(" + ", ".join("?" * ncols) + ")"
    return f"{head} VALUES " + ", ".join([row] * nrows)


def accounted_bytes(payload_len: int, topic: str) -> int:
    """Bytes a row counts against `max_bytes`."""
    return payload_len + len(topic) + ROW_OVERHEAD


async def _open(path: Path) -> aiosqlite.Connection:
    conn = await aiosqlite.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT
    try:
        await conn.execute("PRAGMA journal_mode=WAL")
        await conn.execute("PRAGMA busy_timeout=5000")
        await conn.executescript(SCHEMA)
        await conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        async with conn.execute("SELECT count(*) FROM outbox"):
            pass
    except sqlite3.DatabaseError:
        await conn.close()
        raise
    return conn


async def open_database(path: Path, metrics: Metrics | None = None) -> aiosqlite.Connection:
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


class Outbox:
    """Durable, bounded outbox with group commit.  See the module docstring."""

    def __init__(
        self,
        conn: aiosqlite.Connection,
        settings: BufferSettings,
        gateway_id: str,
        metrics: Metrics,
    ) -> None:
        self._conn = conn
        self._settings = settings
        self._gateway_id = gateway_id
        self._gateway_hash = gateway_hash32(gateway_id)
        self._metrics = metrics
        self._sync_insert = settings.synchronous.upper()
        self._sync_now = ""  # PRAGMA synchronous as last set (only this class sets it)
        self._limited = RateLimitedLog(log)
        self._epoch = 0
        self._route_ids: dict[Route | tuple[str, str], int] = {}
        self._route_names: dict[int, tuple[str, str]] = {}
        self._pending = _Group()
        # Every statement of the running outbox goes through this lock: the
        # committer, the forwarder, ingest's dead letters and housekeeping share
        # one connection, and a BEGIN ... COMMIT spans awaits.  Without it their
        # transactions interleave ("cannot start a transaction within a
        # transaction"), a read sees another task's uncommitted rows, and one
        # task's PRAGMA synchronous changes another's commit.
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._data_available = asyncio.Event()
        self._closed = False
        self._committer: asyncio.Task[None] | None = None
        self._failure: StoreError | None = None
        # Insertion-ordered and bounded.  An OrderedDict because trimming a plain
        # dict from the front with next(iter(d)) rescans its deleted slots: that
        # was 10 us per record at 20k entries, the largest cost in _insert.
        self._recent: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._recent_count = 0
        self.records = 0
        self.bytes = 0

    # -- life cycle -------------------------------------------------------

    @classmethod
    async def open(cls, path: Path, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> Outbox:
        conn = await open_database(path, metrics)
        box = cls(conn, settings, gateway_id, metrics)
        await box._load()
        return box

    async def _load(self) -> None:
        epoch = await self._meta("epoch")
        if epoch is None:
            epoch = str(secrets.randbits(32))
            await self._conn.execute("INSERT INTO meta(key, value) VALUES ('epoch', ?)", (epoch,))
        self._epoch = int(epoch)
        async with self._conn.execute("SELECT id, stream, topic FROM routes") as cur:
            for rid, stream, topic in await cur.fetchall():
                self._route_ids[(stream, topic)] = rid
                self._route_names[rid] = (stream, topic)
        async with self._conn.execute(
            "SELECT count(*), coalesce(sum(length(payload) + length(mqtt_topic)), 0) FROM outbox"
        ) as cur:
            row = await cur.fetchone()
        assert row is not None
        self.records = int(row[0])
        self.bytes = int(row[1]) + ROW_OVERHEAD * self.records
        async with self._conn.execute(
            "SELECT mqtt_topic, device_seq, crc FROM ingest_recent ORDER BY seq DESC LIMIT ?",
            (RECENT_WINDOW,),
        ) as cur:
            recent = list(await cur.fetchall())
        for topic, dseq, crc in reversed(recent):
            self._recent[(topic, dseq, crc)] = None
        self._recent_count = len(recent)
        self._update_gauges()
        if self.records:
            self._data_available.set()

    def seen(self, mqtt_topic: str, device_seq: int, crc: int) -> bool:
        """Was a record with this topic, device sequence and payload CRC
        committed recently?  (Used for broker redeliveries only.)"""
        return (mqtt_topic, device_seq, crc) in self._recent

    async def _last_seq(self) -> int:
        async with self._conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'") as cur:
            row = await cur.fetchone()
        return 0 if row is None else int(row[0])

    def start(self) -> None:
        self._committer = asyncio.create_task(self._commit_loop(), name="outbox-commit")

    async def close(self) -> None:
        """Commit what is pending, stop the committer and close the file."""
        self._closed = True
        self._wakeup.set()
        if self._committer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._committer
        with contextlib.suppress(sqlite3.Error):
            await self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        await self._conn.close()

    @property
    def connection(self) -> aiosqlite.Connection:
        return self._conn

    @property
    def epoch(self) -> int:
        return self._epoch

    async def _meta(self, key: str) -> str | None:
        async with self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)) as cur:
            row = await cur.fetchone()
        return None if row is None else str(row[0])

    async def _synchronous(self, level: str) -> None:
        """PRAGMA synchronous for the next commit (lock held), skipping the round
        trip when it is already set: inserts use the configured level, deletes
        NORMAL, and only this class sets it on this connection."""
        if self._sync_now != level:
            await self._conn.execute(f"PRAGMA synchronous={level}")
            self._sync_now = level

    # -- ingest side ------------------------------------------------------

    def submit(self, item: Incoming) -> asyncio.Future[None]:
        """Queue a record for the next group commit (synchronous, so arrival
        order is kept) and return the future of that commit."""
        if self._failure is not None:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.set_exception(self._failure)
            return fut
        group = self._pending
        if group.done is None:
            group.done = asyncio.get_running_loop().create_future()
        group.items.append(item)
        if len(group.items) == 1 or len(group.items) >= self._settings.commit_max_records:
            self._wakeup.set()
        return group.done

    @property
    def pending_count(self) -> int:
        return len(self._pending.items)

    async def wait_pending_below(self, limit: int) -> None:
        """Return once fewer than `limit` records wait for their commit (ingest
        uses it to stop reading from the broker's socket under overload)."""
        while len(self._pending.items) >= limit and self._pending.done is not None:
            await asyncio.wait([self._pending.done])  # never raises the commit's error

    async def _commit_loop(self) -> None:
        interval = self._settings.commit_interval_ms / 1000
        while True:
            if not self._pending.items:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if interval and len(self._pending.items) < self._settings.commit_max_records and not self._closed:
                # Let more handlers join this group; the ack latency this adds
                # is bounded by commit_interval_ms.
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), interval)
            # The whole group commits at once: its size is bounded by the broker's
            # in-flight window (receive maximum) plus the QoS0 queue limit.
            group, self._pending = self._pending, _Group()
            await self._commit_group(group)

    async def _commit_group(self, group: _Group) -> None:
        started = time.perf_counter()
        done = group.done
        try:
            async with self._lock:
                await self._insert(group.items)
        except (sqlite3.Error, OSError) as e:
            self._metrics.store_errors.inc()
            err = StoreError(f"commit failed: {e}")
            log.error("outbox commit of %d records failed: %s", len(group.items), e)
            if done is not None and not done.done():
                done.set_exception(err)
                done.exception()  # mark retrieved: each waiter re-raises it
            return
        self._metrics.store_commit_seconds.observe(time.perf_counter() - started)
        if done is not None and not done.done():
            done.set_result(None)

    async def _route_id(self, route: Route) -> int:
        key = (route.stream, route.topic)
        rid = self._route_ids.get(key)
        if rid is None:
            await self._conn.execute("INSERT OR IGNORE INTO routes(stream, topic) VALUES (?, ?)", key)
            async with self._conn.execute("SELECT id FROM routes WHERE stream = ? AND topic = ?", key) as cur:
                row = await cur.fetchone()
            assert row is not None
            rid = int(row[0])
            self._route_ids[key] = rid
            self._route_names[rid] = key
        return rid

    async def _insert(self, items: list[Incoming]) -> None:
        s = self._settings
        rows = []
        add_bytes = 0
        for it in items:
            if (it.route.stream, it.route.topic) not in self._route_ids:
                await self._route_id(it.route)
        for it in items:
            rid = self._route_ids[(it.route.stream, it.route.topic)]
            rows.append(
                (
                    rid,
                    it.route.key,
                    it.mqtt_topic,
                    it.qos | (int(it.retain) << 2),
                    it.received_us,
                    it.device_seq,
                    it.payload,
                )
            )
            add_bytes += accounted_bytes(len(it.payload), it.mqtt_topic)
        rejected = trimmed = 0
        if s.overflow == "drop_oldest":
            # a group bigger than the whole bound: its own oldest rows go too
            while rows and (len(rows) > s.max_records or add_bytes > s.max_bytes):
                row = rows.pop(0)
                add_bytes -= accounted_bytes(len(row[6]), row[2])
                trimmed += 1
        over_records = self.records + len(rows) - s.max_records
        over_bytes = self.bytes + add_bytes - s.max_bytes
        if (over_records > 0 or over_bytes > 0) and s.overflow == "reject_new":
            # keep the oldest; refuse the newest rows that do not fit
            while rows and (self.records + len(rows) > s.max_records or self.bytes + add_bytes > s.max_bytes):
                row = rows.pop()
                add_bytes -= accounted_bytes(len(row[6]), row[2])
                rejected += 1
        await self._synchronous(self._sync_insert)
        try:
            await self._conn.execute("BEGIN IMMEDIATE")  # inside try: a cancelled BEGIN still rolls back
            freed_records = freed_bytes = 0
            if s.overflow == "drop_oldest" and (over_records > 0 or over_bytes > 0):
                freed_records, freed_bytes = await self._drop_oldest(max(over_records, 0), max(over_bytes, 0))
            if rejected:
                await self._count_drop("buffer_full_rejected", rejected)
            if freed_records + trimmed:
                await self._count_drop("buffer_full_oldest", freed_records + trimmed)
            recent: list[tuple[str, int, int, int]] = []
            if rows:
                await self._insert_rows(
                    "INSERT INTO outbox(route_id, pkey, mqtt_topic, flags, received_us, device_seq, payload)",
                    7,
                    rows,
                )
                # Only QoS1/2 can come back as a broker redelivery (flags & 3 is
                # the QoS): QoS0 records need no entry in the redelivery window.
                recent = [
                    (r[2], r[5], zlib.crc32(r[6]), i)
                    for i, r in enumerate(rows)
                    if r[5] is not None and r[3] & 3
                ]
                if recent:
                    last_seq = await self._last_seq()
                    first = last_seq - len(rows) + 1
                    await self._insert_rows(
                        "INSERT OR REPLACE INTO ingest_recent(seq, mqtt_topic, device_seq, crc)",
                        4,
                        [(first + i, topic, dseq, crc) for topic, dseq, crc, i in recent],
                    )
                    self._recent_count += len(recent)
                    if self._recent_count > 2 * RECENT_WINDOW:
                        await self._conn.execute(
                            "DELETE FROM ingest_recent WHERE seq <= ?", (last_seq - RECENT_WINDOW,)
                        )
                        self._recent_count = RECENT_WINDOW
            await self._conn.execute("COMMIT")
            for topic, dseq, crc, _ in recent:
                self._recent[(topic, dseq, crc)] = None
            while len(self._recent) > RECENT_WINDOW:
                self._recent.popitem(last=False)
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await self._conn.execute("ROLLBACK")
            raise
        self.records += len(rows) - freed_records
        self.bytes += add_bytes - freed_bytes
        self._metrics.store_committed.inc(len(rows))
        if freed_records + trimmed:
            self._metrics.dropped.labels("buffer_full_oldest").inc(freed_records + trimmed)
            self._limited.warning(
                "drop_oldest",
                "outbox full (%d records, %d bytes): dropped the %d oldest records (policy drop_oldest)",
                self.records,
                self.bytes,
                freed_records + trimmed,
            )
        if rejected:
            self._metrics.dropped.labels("buffer_full_rejected").inc(rejected)
            self._limited.warning(
                "reject_new",
                "outbox full (%d records, %d bytes): rejected %d new records (policy reject_new)",
                self.records,
                self.bytes,
                rejected,
            )
        self._update_gauges()
        if rows:
            self._data_available.set()

    async def _insert_rows(self, head: str, ncols: int, rows: Sequence[tuple[Any, ...]]) -> None:
        """`head` VALUES (...), (...), ...: up to ROWS_PER_INSERT rows per
        statement, in order.  The sqlite3 module releases and re-takes the GIL
        around every statement it steps; while ingest parses MQTT packets on the
        loop thread each re-take can wait, so one statement per row made a large
        group commit crawl.  Fewer, larger statements keep the commit short."""
        n = ROWS_PER_INSERT
        full = len(rows) // n
        if full:
            await self._conn.executemany(
                _values_sql(head, ncols, n),
                [tuple(chain.from_iterable(rows[i * n : (i + 1) * n])) for i in range(full)],
            )
        if len(rows) > full * n:
            rest = rows[full * n :]
            await self._conn.execute(_values_sql(head, ncols, len(rest)), tuple(chain.from_iterable(rest)))

    async def _count_drop(self, reason: str, n: int) -> None:
        await self._conn.execute(
            "INSERT INTO drops(reason, count) VALUES (?, ?)"
            " ON CONFLICT(reason) DO UPDATE SET count = count + excluded.count",
            (reason, n),
        )

    async def _drop_oldest(self, records: int, nbytes: int) -> tuple[int, int]:
        """Delete the oldest rows until `records` rows and `nbytes` accounted
        bytes are freed (inside the caller's transaction)."""
        freed_r = freed_b = 0
        while freed_r < records or freed_b < nbytes:
            # Look at the oldest rows in chunks, delete exactly the prefix that
            # frees enough (no more: every extra row would be data lost for nothing).
            async with self._conn.execute(
                "SELECT seq, length(payload) + length(mqtt_topic) FROM outbox ORDER BY seq LIMIT ?",
                (max(records - freed_r, 64),),
            ) as cur:
                oldest = list(await cur.fetchall())
            if not oldest:
                break
            last = oldest[-1][0]
            for seq, size in oldest:
                freed_r += 1
                freed_b += int(size) + ROW_OVERHEAD
                if freed_r >= records and freed_b >= nbytes:
                    last = seq
                    break
            await self._conn.execute("DELETE FROM outbox WHERE seq <= ?", (last,))
        return freed_r, freed_b

    # -- dead letters -----------------------------------------------------

    async def dead_letter(
        self,
        *,
        mqtt_topic: str | bytes,
        payload: bytes,
        qos: int,
        retain: bool,
        reason: str,
        detail: str,
        received_us: int | None = None,
    ) -> None:
        """Store a message that cannot be routed, with its reason (committed
        before returning, like any record)."""
        async with self._lock:
            await self._dead_letter(mqtt_topic, payload, qos, retain, reason, detail, received_us)

    async def _dead_letter(
        self,
        mqtt_topic: str | bytes,
        payload: bytes,
        qos: int,
        retain: bool,
        reason: str,
        detail: str,
        received_us: int | None,
    ) -> None:
        topic_b = mqtt_topic.encode() if isinstance(mqtt_topic, str) else mqtt_topic
        cap = self._settings.max_payload_bytes
        await self._synchronous(self._sync_insert)
        try:
            await self._conn.execute("BEGIN IMMEDIATE")  # inside try: a cancelled BEGIN still rolls back
            await self._conn.execute(
                "INSERT INTO dead_letters(received_us, mqtt_topic, qos, retain, reason, detail, payload,"
                " payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    received_us or time.time_ns() // 1000,
                    topic_b[:1024],
                    qos,
                    int(retain),
                    reason,
                    detail,
                    payload[:cap],
                    len(payload),
                ),
            )
            await self._conn.execute(
                "DELETE FROM dead_letters WHERE id <= (SELECT max(id) FROM dead_letters) - ?",
                (self._settings.max_dead_letters,),
            )
            await self._conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as e:
            with contextlib.suppress(sqlite3.Error):
                await self._conn.execute("ROLLBACK")
            self._metrics.store_errors.inc()
            raise StoreError(f"dead letter not stored: {e}") from e
        except BaseException:  # cancelled: leave no transaction open on the shared connection
            with contextlib.suppress(sqlite3.Error):
                await self._conn.execute("ROLLBACK")
            raise
        self._metrics.dead_letters.labels(reason).inc()
        self._limited.warning(
            f"dead:{reason}", "dead letter (%s): topic %r: %s", reason, topic_b[:200], detail
        )

    # -- forward side -----------------------------------------------------

    async def wait_for_data(self, timeout: float | None = None) -> bool:
        if self.records > 0:
            return True
        self._data_available.clear()
        try:
            await asyncio.wait_for(self._data_available.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def read_batch(self, max_records: int, max_bytes: int) -> list[OutboundRecord]:
        """The oldest records, in seq order, up to the limits (at least one)."""
        async with self._lock:
            rows = await self._conn.execute_fetchall(  # one round trip to the SQLite thread
                "SELECT seq, route_id, pkey, mqtt_topic, flags, received_us, device_seq, payload"
                " FROM outbox ORDER BY seq LIMIT ?",
                (max_records,),
            )
        out: list[OutboundRecord] = []
        total = 0
        high = (self._gateway_hash << 96) | (self._epoch << 64)
        gw = self._gateway_id
        names = self._route_names
        for seq, rid, pkey, topic, flags, recv, dseq, payload in rows:
            total += len(payload)
            if out and total > max_bytes:
                break
            stream, itopic = names[rid]
            headers = {
                HEADER_MQTT_TOPIC: topic,
                HEADER_QOS: str(flags & 3),
                HEADER_RETAIN: "1" if flags & 4 else "0",
                HEADER_GATEWAY: gw,
                HEADER_RECEIVED_US: str(recv),
            }
            if dseq is not None:
                headers[HEADER_DEVICE_SEQ] = str(dseq)
            out.append(OutboundRecord(seq, high | seq, stream, itopic, pkey, payload, headers))
        return out

    async def confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None) -> int:
        """Delete what Iggy confirmed: the whole batch, or only `confirmed` seqs."""
        async with self._lock:
            return await self._confirm(batch, confirmed)

    async def _confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None) -> int:
        if not batch:
            return 0
        if confirmed is None:
            gone = batch
        else:
            gone = [r for r in batch if r.seq in confirmed]
            if not gone:
                return 0
        await self._synchronous("NORMAL")
        deleted_before = self._conn.total_changes
        if confirmed is None:
            # One statement is its own transaction (autocommit): one round trip
            # to the SQLite thread instead of BEGIN / DELETE / COMMIT.
            await self._conn.execute_fetchall(
                "DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (batch[0].seq, batch[-1].seq)
            )
        else:
            try:
                await self._conn.execute("BEGIN IMMEDIATE")  # inside try: a cancelled BEGIN still rolls back
                await self._conn.executemany("DELETE FROM outbox WHERE seq = ?", [(r.seq,) for r in gone])
                await self._conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    await self._conn.execute("ROLLBACK")
                raise
        deleted = self._conn.total_changes - deleted_before
        # Rows dropped by drop_oldest while in flight were already accounted.
        if deleted:
            freed = sum(accounted_bytes(len(r.payload), r.headers[HEADER_MQTT_TOPIC]) for r in gone)
            if deleted != len(gone):
                freed = freed * deleted // len(gone)
            self.records -= deleted
            self.bytes -= freed
        self._update_gauges()
        return deleted

    async def expire(self, now_us: int | None = None) -> int:
        """Delete records older than ttl_s (oldest first); counted as dropped."""
        ttl = self._settings.ttl_s
        if not ttl or not self.records:
            return 0
        cutoff = (now_us or time.time_ns() // 1000) - ttl * 1_000_000
        total = 0
        while True:
            async with self._lock:  # per chunk, so ingest commits go on between chunks
                sizes = await self._expire_chunk(cutoff)
            if not sizes:
                break
            total += len(sizes)
            self.records -= len(sizes)
            self.bytes -= sum(int(x[0]) for x in sizes) + ROW_OVERHEAD * len(sizes)
        if total:
            self._metrics.dropped.labels("ttl_expired").inc(total)
            log.warning("expired %d outbox records older than ttl_s=%d", total, ttl)
        self._update_gauges()
        return total

    async def _expire_chunk(self, cutoff: int) -> list[Any]:
        try:
            await self._conn.execute("BEGIN IMMEDIATE")  # inside try: a cancelled BEGIN still rolls back
            async with self._conn.execute(
                "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE received_us < ?"
                " ORDER BY seq LIMIT 5000) RETURNING length(payload) + length(mqtt_topic)",
                (cutoff,),
            ) as cur:
                sizes = list(await cur.fetchall())
            if sizes:
                await self._count_drop("ttl_expired", len(sizes))
            await self._conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await self._conn.execute("ROLLBACK")
            raise
        return sizes

    async def oldest_received_us(self) -> int | None:
        async with (
            self._lock,
            self._conn.execute("SELECT received_us FROM outbox ORDER BY seq LIMIT 1") as cur,
        ):
            row = await cur.fetchone()
        return None if row is None else int(row[0])

    async def refresh_age_gauge(self) -> None:
        oldest = await self.oldest_received_us()
        self._metrics.backlog_oldest_age.set(0 if oldest is None else max(0.0, time.time() - oldest / 1e6))

    def _update_gauges(self) -> None:
        self._metrics.backlog_records.set(self.records)
        self._metrics.backlog_bytes.set(self.bytes)

    def fail(self, err: StoreError) -> None:
        """Refuse further submissions (used when the disk is gone)."""
        self._failure = err
