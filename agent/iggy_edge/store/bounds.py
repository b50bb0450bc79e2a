"""Bounds and expiry: `max_records` / `max_bytes` with the overflow policy at
insert time, and `ttl_s`.  Every drop is counted by reason (metrics and the
`drops` table) and logged, rate-limited."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .base import OutboxBase
from .schema import ROW_OVERHEAD, accounted_bytes

log = logging.getLogger(__name__)

EXPIRE_CHUNK = 5000


@dataclass(slots=True)
class _Fit:
    """What of a group fits the bounds (decided before its transaction)."""

    rows: list[tuple[Any, ...]]
    add_bytes: int
    trimmed: int  # drop_oldest: the group's own oldest rows (group larger than the bound)
    rejected: int  # reject_new: the group's newest rows that do not fit
    over_records: int
    over_bytes: int


class Bounds(OutboxBase):
    def _fit(self, rows: list[tuple[Any, ...]], add_bytes: int) -> _Fit:
        s = self._settings
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
        return _Fit(rows, add_bytes, trimmed, rejected, over_records, over_bytes)

    async def _make_room(self, fit: _Fit) -> tuple[int, int]:
        """Inside the insert's transaction: drop the oldest rows the policy
        asks for and count the drops.  Returns (records, bytes) freed."""
        freed_records = freed_bytes = 0
        if self._settings.overflow == "drop_oldest" and (fit.over_records > 0 or fit.over_bytes > 0):
            freed_records, freed_bytes = await self._drop_oldest(
                max(fit.over_records, 0), max(fit.over_bytes, 0)
            )
        if fit.rejected:
            await self._count_drop("buffer_full_rejected", fit.rejected)
        if freed_records + fit.trimmed:
            await self._count_drop("buffer_full_oldest", freed_records + fit.trimmed)
        return freed_records, freed_bytes

    def _report_drops(self, fit: _Fit, freed_records: int) -> None:
        """After the commit: metrics and rate-limited log lines."""
        if freed_records + fit.trimmed:
            self._metrics.dropped.labels("buffer_full_oldest").inc(freed_records + fit.trimmed)
            self._limited.warning(
                "drop_oldest",
                "outbox full (%d records, %d bytes): dropped the %d oldest records (policy drop_oldest)",
                self.records,
                self.bytes,
                freed_records + fit.trimmed,
            )
        if fit.rejected:
            self._metrics.dropped.labels("buffer_full_rejected").inc(fit.rejected)
            self._limited.warning(
                "reject_new",
                "outbox full (%d records, %d bytes): rejected %d new records (policy reject_new)",
                self.records,
                self.bytes,
                fit.rejected,
            )

    async def _drop_oldest(self, records: int, nbytes: int) -> tuple[int, int]:
        """Delete the oldest rows until `records` rows and `nbytes` accounted
        bytes are freed (inside the caller's transaction)."""
        freed_r = freed_b = 0
        while freed_r < records or freed_b < nbytes:
            # Look at the oldest rows in chunks, delete exactly the prefix that
            # frees enough (no more: every extra row would be data lost for nothing).
            async with self._conn.execute(
                "SELECT seq, length(payload) + length(mqtt_topic) FROM outbox_rows ORDER BY seq LIMIT ?",
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

    async def expire(self, now_us: int | None = None) -> int:
        """Delete records older than ttl_s (oldest first); counted as dropped."""
        ttl = self._settings.ttl_s
        if not ttl or not self.records:
            return 0
        cutoff = (now_us or time.time_ns() // 1000) - ttl * 1_000_000
        total = 0
        while True:
            async with self._db.write():  # per chunk, so ingest commits go on between chunks
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
        async with self._conn.execute(
            "DELETE FROM outbox WHERE seq IN (SELECT seq FROM outbox WHERE received_us < ?"
            " ORDER BY seq LIMIT ?)"
            " RETURNING length(payload) + (SELECT length(mqtt_topic) FROM sources WHERE id = source_id)",
            (cutoff, EXPIRE_CHUNK),
        ) as cur:
            sizes = list(await cur.fetchall())
        if sizes:
            await self._count_drop("ttl_expired", len(sizes))
        return sizes
