"""Ingest's side of the outbox: submit records, commit them in groups."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Any, Final, Literal
from zlib import crc32

from ..config import BufferSettings
from ..metrics import Metrics
from ..records import Route
from ..routing import Rejected
from ..timeouts import wait_for
from .base import Backlog, Handover, Part, RecentKey, recent_key, redelivery_key
from .bounds import Bounds
from .db import Database, StoreError
from .dead import DEAD_GROUP_MAX, DeadLetters
from .devices import Devices
from .schema import RECENT_TRIM, RECENT_WINDOW, ROW_OVERHEAD, ROWS_PER_INSERT
from .sources import Catalog

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Incoming:
    """A message for `GroupCommit.submit` (tests, benches, tools; ingest
    hands its messages to `take` field by field, without this object)."""

    route: Route
    mqtt_topic: str
    qos: int
    retain: bool
    received_us: int
    payload: bytes
    device_seq: int | None = None
    # `redelivery_key` (when the caller computed it); None: derived at submit
    key: RecentKey | None = None


# A record in the open group: (route, MQTT topic, flags (qos | retain << 2),
# received_us, device seq, payload, redelivery key).  A plain tuple: building
# a dataclass per message cost ingest 0.4 us of its ~15.
Item = tuple[Route, str, int, int, int | None, bytes, RecentKey | None]
# The redelivery window's "no entry" (a value there is None or a group's future)
_NONE: Final[Any] = object()


@dataclass
class _Group:
    items: list[Item] = field(default_factory=list)
    done: asyncio.Future[None] | None = None
    nbytes: int = 0  # payload bytes
    # The redelivery keys this group put in the window (with its future).
    keys: list[RecentKey] = field(default_factory=list)
    # MQTT topic -> the route its records in this group were admitted and
    # reserved with (`Devices.reserve`), once per source and group, not per
    # record; `reserved` lists them for `Devices.settle`.
    sources: dict[str, Route] = field(default_factory=dict)
    reserved: list[tuple[str, str]] = field(default_factory=list)


@lru_cache(maxsize=64)
def _values_sql(head: str, ncols: int, nrows: int) -> str:
    row = "(" + ", ".join("?" * ncols) + ")"
    return f"{head} VALUES " + ", ".join([row] * nrows)


class GroupCommit(Part):
    """Group commit: `submit` queues synchronously (arrival order), one
    committer task writes each group in one transaction (and the dead-letter
    groups, dead.py).  Owns the open group and the redelivery window."""

    def __init__(
        self,
        db: Database,
        settings: BufferSettings,
        metrics: Metrics,
        *,
        handover: Handover,
        backlog: Backlog,
        catalog: Catalog,
        devices: Devices,
        bounds: Bounds,
        dead: DeadLetters,
    ) -> None:
        super().__init__(db, settings, metrics)
        self._handover = handover
        self._backlog = backlog
        self._catalog = catalog
        self._devices = devices
        self._bounds = bounds
        self._dead = dead
        self._pending = _Group()
        self._committing: _Group | None = None  # the group whose commit is under way
        # The redelivery window: key (`redelivery_key`) -> None for a
        # committed record, or the future of the group commit it waits for
        # (done: committed; a failed commit takes its keys out first).  A key
        # goes in when its record is submitted, so recognising a copy is one
        # lookup whether its original is committed or pending.
        # Insertion-ordered and bounded (the newest RECENT_WINDOW committed
        # keys, plus those of the open group).  An OrderedDict because
        # trimming a plain dict from the front with next(iter(d)) rescans its
        # deleted slots: that was 10 us per record at 20k entries.
        # Keys are `recent_key`s: 169 bytes an entry against 274 for a
        # (topic, seq, crc) triple with its own topic string (2 MB less at 20k).
        self._recent: OrderedDict[RecentKey, asyncio.Future[None] | None] = OrderedDict()
        self._recent_count = 0

    def copy_of(self, key: RecentKey) -> asyncio.Future[None] | bool:
        """Redelivery recognition, in one place: is a message with this
        `redelivery_key` a copy of a record submitted before?  True when that
        record is committed (in the redelivery window), the future of its
        group commit while it waits for it (acknowledge the copy with it),
        False when there is none.  (`take` does this for ingest.)"""
        known = self._recent.get(key, _NONE)
        if known is _NONE:
            return False
        return True if known is None or known.done() else known

    def take(
        self,
        route: Route,
        mqtt_topic: str,
        qos: int,
        retain: int,
        received_us: int,
        payload: bytes,
        device_seq: int | None,
        check: bool,
    ) -> asyncio.Future[None] | Rejected | Literal[True]:
        """Ingest's one call per message (synchronous: arrival order is
        outbox order): admission by the per-device bounds (`Devices.admit`,
        once per source and group), redelivery recognition when `check`,
        and the record's place in the open group.

        Returns the future of the group commit to acknowledge the message
        after (its own, or its original's while that waits), True for a copy
        of a committed record (acknowledge it now, nothing is stored;
        counted), or why it is refused (a dead letter)."""
        group = self._pending
        reserved = group.sources.get(mqtt_topic) is route
        if not reserved:
            rejected = self._devices.admit(route, mqtt_topic)
            if rejected is not None:
                return rejected
        done = group.done
        if done is None:
            done = group.done = asyncio.get_running_loop().create_future()
        key = None
        if device_seq is not None and qos:
            # = redelivery_key(mqtt_topic, qos, device_seq, payload), inline (the hot path)
            key = (sys.intern(mqtt_topic), device_seq << 32 | crc32(payload))
            known = self._recent.get(key, _NONE)
            if known is _NONE:
                self._recent[key] = done
                group.keys.append(key)
            elif check:
                self._metrics.ingest_known_copies.inc()
                return True if known is None or known.done() else known
        # (what _add does, inline: a call less per message)
        group.items.append((route, mqtt_topic, qos | retain << 2, received_us, device_seq, payload, key))
        if not reserved:
            self._reserve(group, route, mqtt_topic)
        n = len(payload)
        group.nbytes += n
        self._handover.pending_bytes += n
        backlog = self._backlog
        if n > backlog.payload_high:  # noqa: PLR1730 - max() is one more call per message
            backlog.payload_high = n
        count = len(group.items)
        if count == 1 or count == self._settings.commit_max_records:  # noqa: PLR1714 - see _add
            self._handover.wakeup.set()
        return done

    def submit(self, item: Incoming) -> asyncio.Future[None]:
        """Queue a record for the next group commit, without admission or
        recognition (synchronous, so arrival order is kept) and return the
        future of that commit."""
        group = self._pending
        done = group.done
        if done is None:
            done = group.done = asyncio.get_running_loop().create_future()
        key = item.key
        if key is None and item.device_seq is not None:
            key = item.key = redelivery_key(item.mqtt_topic, item.qos, item.device_seq, item.payload)
        if key is not None and self._recent.setdefault(key, done) is done:
            group.keys.append(key)
        flags = item.qos | int(item.retain) << 2
        row = (item.route, item.mqtt_topic, flags, item.received_us, item.device_seq, item.payload, key)
        self._add(group, row)
        return done

    def _add(self, group: _Group, item: Item) -> None:
        group.items.append(item)
        route, topic = item[0], item[1]
        if group.sources.get(topic) is not route:
            self._reserve(group, route, topic)
        n = len(item[5])
        group.nbytes += n
        self._handover.pending_bytes += n
        self._backlog.payload_high = max(self._backlog.payload_high, n)
        count = len(group.items)
        # == not >= (and no tuple built per message for `in`): the committer
        # needs one wake-up, not one per record past the limit
        if count == 1 or count == self._settings.commit_max_records:  # noqa: PLR1714
            self._handover.wakeup.set()

    def _reserve(self, group: _Group, route: Route, topic: str) -> None:
        """The group's first record of this source (`Devices.reserve`)."""
        group.sources[topic] = route
        group.reserved.append((route.key, topic))
        self._devices.reserve(route.key, topic)

    @property
    def pending_count(self) -> int:
        return len(self._pending.items)

    async def wait_pending_below(self, limit: int, *, max_bytes: int | None = None) -> None:
        """Return once fewer than `limit` records wait for their commit and,
        with `max_bytes`, fewer than that many payload bytes of records and
        dead letters (`pending_bytes`); ingest uses it to stop reading from the
        broker's socket under overload.  Never raises a commit's error."""
        while len(self._pending.items) >= limit and self._pending.done is not None:
            await asyncio.wait([self._pending.done])
        if max_bytes is not None:
            while self._handover.pending_bytes >= max_bytes:
                self._handover.progress.clear()
                await self._handover.progress.wait()

    async def commit_loop(self) -> None:
        interval = self._settings.commit_interval_ms / 1000
        while True:
            if not self._pending.items and not self._dead.groups:
                if self._handover.closed:
                    return
                self._handover.wakeup.clear()
                await self._handover.wakeup.wait()
                continue
            if interval and not self._handover.closed and self._room_to_wait():
                # Let more handlers join this group; the ack latency this adds
                # is bounded by commit_interval_ms.
                self._handover.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await wait_for(self._handover.wakeup.wait(), interval)
            if self._pending.items:
                # The whole group commits at once: its size is bounded by the broker's
                # in-flight window (receive maximum) plus the QoS0 queue limit.
                group = self._committing = self._pending
                self._pending = _Group()
                try:
                    await self._commit_group(group)
                finally:
                    self._committing = None
            await self._dead.commit_groups()

    def _room_to_wait(self) -> bool:
        """Is the open group small enough to wait for more?"""
        if self._pending.items:
            return len(self._pending.items) < self._settings.commit_max_records
        return len(self._dead.groups) == 1 and len(self._dead.groups[0].rows) < DEAD_GROUP_MAX

    async def _commit_group(self, group: _Group) -> None:
        started = time.perf_counter()
        done = group.done
        try:
            async with self._lock:
                await self._insert(group.items)
        except (sqlite3.Error, OSError) as e:
            self._unremember(group.keys, done)
            self._devices.settle(group.reserved)
            self._handover.release(group.nbytes)
            self._metrics.store_errors.inc()
            err = StoreError(f"commit failed: {e}")
            log.error("outbox commit of %d records failed: %s", len(group.items), e)
            if done is not None and not done.done():
                done.set_exception(err)
                done.exception()  # mark retrieved: each waiter re-raises it
            return
        except BaseException:
            self._unremember(group.keys, done)  # not committed: copies are new again
            raise
        self._devices.settle(group.reserved)
        self._handover.release(group.nbytes)
        self._metrics.store_commit_seconds.observe(time.perf_counter() - started)
        if done is not None and not done.done():
            done.set_result(None)

    def _unremember(self, keys: Sequence[RecentKey], done: asyncio.Future[None] | None) -> None:
        """Take the keys of records that were not committed out of the
        window; a record of the open group with one of those keys (submitted
        without `check`) holds it now."""
        recent = self._recent
        for key in keys:
            if recent.get(key, _NONE) is done:
                del recent[key]
        group = self._pending
        if group is not self._committing and group.done is not None:
            for item in group.items:
                held = item[6]
                if held is not None and held not in recent:
                    recent[held] = group.done
                    group.keys.append(held)

    async def _last_seq(self) -> int:
        row = await self._db.fetchone("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'")
        return 0 if row is None else int(row[0])

    async def _insert(self, items: list[Item]) -> None:
        """Write one group (lock held): bounds first, then one transaction."""
        rows = []
        add_bytes = ROW_OVERHEAD * len(items)  # = sum of accounted_bytes
        route_ids = self._catalog.route_ids
        rids: dict[int, int] = {}  # id(route) -> its id (the group's Route objects)
        for route, topic, flags, received_us, dseq, payload, rkey in items:
            rid = rids.get(id(route))
            if rid is None:
                rid = route_ids.get((route.stream, route.topic))
                if rid is None:
                    rid = await self._catalog.route_id(self._db, route.stream, route.topic)
                rids[id(route)] = rid
            rows.append((rid, route.key, topic, flags, received_us, dseq, payload, rkey))
            add_bytes += len(payload) + len(topic)
        fit = self._bounds.fit(rows, add_bytes)
        rows = fit.rows
        await self._db.synchronous(self._sync_insert)
        recent: list[tuple[RecentKey, int]] = []
        new_sources: dict[tuple[int, str, str], int] = {}
        outbox_rows: list[tuple[Any, ...]] = []
        async with self._db.transaction():
            freed_records, freed_bytes = await self._bounds.make_room(fit)
            await self._devices.delete_doomed()
            if rows:
                outbox_rows, new_sources = await self._catalog.source_rows(self._db, rows)
                await self._insert_rows(
                    "INSERT INTO outbox(source_id, flags, received_us, device_seq, payload)", 5, outbox_rows
                )
                # The redelivery window: the rows with a key (redelivery_key)
                recent = [(r[7], i) for i, r in enumerate(rows) if r[7] is not None]
                if recent:
                    await self._remember(recent, len(rows))
        self._devices.doomed.clear()
        for key, sid in new_sources.items():
            self._devices.register_source(sid, key)
        self._devices.rows_added(rows, [r[0] for r in outbox_rows])
        committing = self._committing
        if len(rows) < len(items) and committing is not None:
            # records the bounds dropped are not in the window (a copy is new)
            kept = {r[7] for r in rows}
            dropped = [it[6] for it in items if it[6] is not None and it[6] not in kept]
            self._unremember(dropped, committing.done)
        limit = RECENT_WINDOW + len(self._pending.keys)  # the open group's keys are the newest
        while len(self._recent) > limit:
            self._recent.popitem(last=False)
        self._backlog.records += len(rows) - freed_records
        self._backlog.bytes += fit.add_bytes - freed_bytes
        self._metrics.store_committed.inc(len(rows))
        self._bounds.report_drops(fit, freed_records)
        self._backlog.update_gauges()
        if rows:
            self._backlog.data_available.set()

    async def _remember(self, recent: list[tuple[RecentKey, int]], nrows: int) -> None:
        """Persist the redelivery window entries of the rows just inserted."""
        last_seq = await self._last_seq()
        first = last_seq - nrows + 1
        self._recent_count += len(recent)
        if self._recent_count > RECENT_WINDOW + RECENT_TRIM:
            # Trimmed in small steps and before the insert, so the pages a
            # trim frees are reused at once (trimming after it, at twice the
            # window, left 13 bytes of free pages per record in
            # bench/disk_bench.py).
            await self._conn.execute("DELETE FROM ingest_recent WHERE seq <= ?", (last_seq - RECENT_WINDOW,))
            self._recent_count = RECENT_WINDOW
        await self._insert_rows(
            "INSERT OR REPLACE INTO ingest_recent(seq, mqtt_topic, device_seq, crc)",
            4,
            [(first + i, topic, k >> 32, k & 0xFFFFFFFF) for (topic, k), i in recent],
        )

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
        # The rest in statements of power-of-two sizes, in order: at most 7
        # shapes instead of 127.  The sqlite3 module caches each shape's
        # compiled statement (about 55 KB at this width: 7 MB for 127) and
        # every cached statement keeps its last bound payloads until it is
        # used again (after a flood of 256 KiB payloads that was tens of MB).
        pos, size = full * n, n
        while pos < len(rows):
            while size > len(rows) - pos:
                size //= 2
            chunk = rows[pos : pos + size]
            await self._conn.execute(_values_sql(head, ncols, size), tuple(chain.from_iterable(chunk)))
            pos += size

    # -- the redelivery window ------------------------------------------------

    def seen(self, mqtt_topic: str, device_seq: int, crc: int) -> bool:
        """Was a record with this topic, device sequence and payload CRC
        committed recently?  (Used for broker redeliveries only.)"""
        known = self._recent.get(recent_key(mqtt_topic, device_seq, crc), _NONE)
        return known is None or (known is not _NONE and known.done())

    async def load_recent(self) -> None:
        """At open: the window as the file has it."""
        # In chunks, oldest first: a list of the whole window's rows (3.8 MB at
        # 20k) on top of the window itself raised the RSS of an agent
        # restarted with a backlog for the rest of its life.
        n = 0
        async with (
            self._db.lock,
            self._conn.execute(
                "SELECT mqtt_topic, device_seq, crc FROM (SELECT seq, mqtt_topic, device_seq, crc"
                " FROM ingest_recent ORDER BY seq DESC LIMIT ?) ORDER BY seq",
                (RECENT_WINDOW,),
            ) as cur,
        ):
            while rows := await cur.fetchmany(1000):
                for topic, dseq, crc in rows:
                    self._recent[recent_key(topic, dseq, crc)] = None
                    n += 1
        self._recent_count = n
