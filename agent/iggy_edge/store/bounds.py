"""Bounds and expiry: `max_records` / `max_bytes` with the overflow policy at
insert time (`drop_oldest` takes from the largest devices first: devices.py),
and `ttl_s`.  Every drop is counted by reason (metrics and the
`drops` table) and logged, rate-limited."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..config import BufferSettings
from ..metrics import Metrics
from .base import Backlog, Part
from .db import Database
from .devices import Device, Devices, water_fill
from .schema import COUNT_DROP_SQL, ROW_OVERHEAD, accounted_bytes
from .sources import Catalog

log = logging.getLogger(__name__)

EXPIRE_CHUNK = 5000
_ARMS = 100  # sources per statement when looking for a device's oldest rows (SQLite allows 500)
_OLDEST_ARM = (
    "SELECT * FROM (SELECT seq, source_id, length(payload) FROM outbox"
    " WHERE source_id = ? AND seq > ? ORDER BY seq LIMIT ?)"
)


@dataclass(slots=True)
class _Fit:
    """What of a group fits the bounds (decided before its transaction)."""

    rows: list[tuple[Any, ...]]
    add_bytes: int
    trimmed: int  # drop_oldest: the group's own oldest rows (group larger than the bound)
    rejected: int  # reject_new: the group's newest rows that do not fit
    over_records: int
    over_bytes: int


class Bounds(Part):
    """The bounds' policy over the backlog and the devices (no state)."""

    def __init__(
        self,
        db: Database,
        settings: BufferSettings,
        metrics: Metrics,
        *,
        backlog: Backlog,
        devices: Devices,
        catalog: Catalog,
    ) -> None:
        super().__init__(db, settings, metrics)
        self._backlog = backlog
        self._devices = devices
        self._catalog = catalog

    def fit(self, rows: list[tuple[Any, ...]], add_bytes: int) -> _Fit:
        s = self._settings
        rejected = trimmed = 0
        if s.overflow == "drop_oldest":
            # a group bigger than the whole bound: its own oldest rows go too
            while rows and (len(rows) > s.max_records or add_bytes > s.max_bytes):
                row = rows.pop(0)
                add_bytes -= accounted_bytes(len(row[6]), row[2])
                trimmed += 1
        over_records = self._backlog.records + len(rows) - s.max_records
        over_bytes = self._backlog.bytes + add_bytes - s.max_bytes
        if (over_records > 0 or over_bytes > 0) and s.overflow == "reject_new":
            # keep the oldest; refuse the newest rows that do not fit
            while rows and (
                self._backlog.records + len(rows) > s.max_records
                or self._backlog.bytes + add_bytes > s.max_bytes
            ):
                row = rows.pop()
                add_bytes -= accounted_bytes(len(row[6]), row[2])
                rejected += 1
        return _Fit(rows, add_bytes, trimmed, rejected, over_records, over_bytes)

    async def make_room(self, fit: _Fit) -> tuple[int, int]:
        """Inside the insert's transaction: drop what the policy asks for and
        count the drops.  Returns (records, bytes) freed in the table; rows
        of the group itself that go are removed from `fit` (`trimmed`)."""
        freed_records = freed_bytes = 0
        if self._settings.overflow == "drop_oldest" and (fit.over_records > 0 or fit.over_bytes > 0):
            freed_records, freed_bytes = await self._drop_fair(fit)
        if fit.rejected:
            await self._count_drop("buffer_full_rejected", fit.rejected)
        if freed_records + fit.trimmed:
            await self._count_drop("buffer_full_oldest", freed_records + fit.trimmed)
        return freed_records, freed_bytes

    async def _drop_fair(self, fit: _Fit) -> tuple[int, int]:
        """drop_oldest, fairly (devices.py): the devices with the largest
        share (committed rows plus their rows in this group) give, down to a
        common level, each its own oldest rows first (the table's, then the
        group's).  First by records, then by bytes."""
        group_r: dict[str, int] = {}
        group_b: dict[str, int] = {}
        for r in fit.rows:
            group_r[r[1]] = group_r.get(r[1], 0) + 1
            group_b[r[1]] = group_b.get(r[1], 0) + accounted_bytes(len(r[6]), r[2])
        devices = self._devices.by_key
        freed_r = freed_b = 0
        if fit.over_records > 0:
            shares = {k: d.records for k, d in devices.items() if d.records}
            for k, n in group_r.items():
                shares[k] = shares.get(k, 0) + n
            for key, quota in water_fill(shares, fit.over_records).items():
                d = devices.get(key)
                in_table = min(quota, d.records) if d is not None else 0
                if in_table:
                    got_r, got_b = await self._drop_device_oldest(d, in_table, 0)  # type: ignore[arg-type]
                    freed_r, freed_b = freed_r + got_r, freed_b + got_b
                if quota > in_table:
                    self._trim_group(fit, key, records=quota - in_table, nbytes=0)
        over_bytes = self._backlog.bytes - freed_b + fit.add_bytes - self._settings.max_bytes
        if over_bytes > 0:
            shares = {k: d.bytes for k, d in devices.items() if d.bytes}
            for r in fit.rows:
                shares[r[1]] = shares.get(r[1], 0) + accounted_bytes(len(r[6]), r[2])
            for key, quota in water_fill(shares, over_bytes).items():
                d = devices.get(key)
                in_table = min(quota, d.bytes) if d is not None else 0
                got = 0
                if in_table:
                    got_r, got = await self._drop_device_oldest(d, 0, in_table)  # type: ignore[arg-type]
                    freed_r, freed_b = freed_r + got_r, freed_b + got
                if quota > got:
                    self._trim_group(fit, key, records=0, nbytes=quota - got)
        return freed_r, freed_b

    @staticmethod
    def _trim_group(fit: _Fit, key: str, *, records: int, nbytes: int) -> None:
        """Remove the oldest rows of device `key` from the group until
        `records` rows and `nbytes` accounted bytes are gone."""
        kept = []
        n = b = 0
        for r in fit.rows:
            if r[1] == key and (n < records or b < nbytes):
                n += 1
                size = accounted_bytes(len(r[6]), r[2])
                b += size
                fit.add_bytes -= size
                fit.trimmed += 1
            else:
                kept.append(r)
        fit.rows[:] = kept

    async def _drop_device_oldest(self, d: Device, records: int, nbytes: int) -> tuple[int, int]:
        """Delete the oldest rows of device `d` (all its sources, merged in
        seq order) until `records` rows and `nbytes` accounted bytes are
        freed, no more (inside the caller's transaction)."""
        sids = [sid for sid in d.sids if self._devices.src_rows.get(sid)]
        names = self._catalog.source_names
        freed_r = freed_b = 0
        after = 0
        while sids and (freed_r < records or freed_b < nbytes):
            n = max(records - freed_r, 64)
            oldest: list[tuple[int, int, int]] = []
            for i in range(0, len(sids), _ARMS):
                part = sids[i : i + _ARMS]
                sql = " UNION ALL ".join([_OLDEST_ARM] * len(part)) + " ORDER BY 1 LIMIT ?"
                params: list[int] = []
                for sid in part:
                    params += (sid, after, n)
                async with self._conn.execute(sql, (*params, n)) as cur:
                    oldest += [(int(a), int(b), int(c)) for a, b, c in await cur.fetchall()]
            if not oldest:
                break
            oldest.sort()
            last: dict[int, int] = {}
            for seq, sid, size in oldest[:n]:
                acc = size + len(names[sid][3]) + ROW_OVERHEAD
                freed_r += 1
                freed_b += acc
                last[sid] = seq
                after = seq
                self._devices.row_gone(sid, acc)
                if freed_r >= records and freed_b >= nbytes:
                    break
            await self._conn.executemany(
                "DELETE FROM outbox WHERE source_id = ? AND seq <= ?", list(last.items())
            )
        return freed_r, freed_b

    def report_drops(self, fit: _Fit, freed_records: int) -> None:
        """After the commit: metrics and rate-limited log lines."""
        if freed_records + fit.trimmed:
            self._metrics.dropped.labels("buffer_full_oldest").inc(freed_records + fit.trimmed)
            self._limited.warning(
                "drop_oldest",
                "outbox full (%d records, %d bytes): dropped the %d oldest records (policy drop_oldest)",
                self._backlog.records,
                self._backlog.bytes,
                freed_records + fit.trimmed,
            )
        if fit.rejected:
            self._metrics.dropped.labels("buffer_full_rejected").inc(fit.rejected)
            self._limited.warning(
                "reject_new",
                "outbox full (%d records, %d bytes): rejected %d new records (policy reject_new)",
                self._backlog.records,
                self._backlog.bytes,
                fit.rejected,
            )

    async def expire(self, now_us: int | None = None) -> int:
        """Delete records older than ttl_s (oldest first); counted as dropped."""
        ttl = self._settings.ttl_s
        if not ttl or not self._backlog.records:
            return 0
        cutoff = (now_us or time.time_ns() // 1000) - ttl * 1_000_000
        total = 0
        while True:
            async with self._db.write():  # per chunk, so ingest commits go on between chunks
                sizes = await self._expire_chunk(cutoff)
            if not sizes:
                break
            total += len(sizes)
            self._backlog.records -= len(sizes)
            self._backlog.bytes -= sum(int(x[0]) for x in sizes) + ROW_OVERHEAD * len(sizes)
            for size, sid in sizes:
                self._devices.row_gone(int(sid), int(size) + ROW_OVERHEAD)
        if total:
            self._metrics.dropped.labels("ttl_expired").inc(total)
            log.warning("expired %d outbox records older than ttl_s=%d", total, ttl)
        self._backlog.update_gauges()
        return total

    async def _expire_chunk(self, cutoff: int) -> list[Any]:
        async with self._conn.execute(
            "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE received_us < ?"
            " ORDER BY seq LIMIT ?)"
            " RETURNING length(payload) + (SELECT length(mqtt_topic) FROM sources WHERE id = source_id),"
            " source_id",
            (cutoff, EXPIRE_CHUNK),
        ) as cur:
            sizes = list(await cur.fetchall())
        if sizes:
            await self._count_drop("ttl_expired", len(sizes))
        return sizes

    async def _count_drop(self, reason: str, n: int) -> None:
        """Add `n` to the persistent drop counter (inside the caller's transaction)."""
        await self._conn.execute(COUNT_DROP_SQL, (reason, n))
