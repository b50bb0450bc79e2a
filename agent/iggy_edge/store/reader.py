"""The forwarder's side of the outbox: read the oldest batch, delete what the
uplink confirmed."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Final

from ..config import BufferSettings
from ..metrics import Metrics
from ..records import (
    HEADER_DEVICE_SEQ,
    HEADER_GATEWAY,
    HEADER_MQTT_TOPIC,
    HEADER_QOS,
    HEADER_RECEIVED_US,
    HEADER_RETAIN,
    OutboundRecord,
    gateway_hash32,
)
from ..timeouts import wait_for
from .base import Backlog, Handover, Part
from .db import Database
from .devices import Devices
from .schema import ROW_OVERHEAD
from .sources import Catalog

_QOS: Final = ("0", "1", "2", "3")

# The oldest records after ?1: at most ?2 of them, and no more payload bytes
# than ?3 (at least one record).  The byte cut is made inside SQLite, on the
# payload lengths alone (`length()` of a BLOB column reads the row's header,
# not the blob), so only the payloads of the batch are ever loaded: reading
# `max_records` rows and cutting them here took 200 MB to return five 200 kB
# records (tests/test_store_read_bounds.py).
# The header strings come from SQLite (its thread, beside the event loop's)
# rather than str() per record here.
# When max_records of the largest payload in the outbox fit in max_bytes
# (60-byte telemetry: always), the plain read: the cut above cost a drain 12%.
_READ_BATCH_SMALL: Final = (
    "SELECT seq, source_id, flags, CAST(received_us AS TEXT), CAST(device_seq AS TEXT), payload"
    " FROM outbox WHERE seq > ?1 ORDER BY seq LIMIT ?2"
)
_READ_BATCH: Final = (
    "SELECT seq, source_id, flags, CAST(received_us AS TEXT), CAST(device_seq AS TEXT), payload"
    " FROM outbox WHERE seq > ?1 AND seq <= ("
    " SELECT max(seq) FROM ("
    "  SELECT seq, sum(len) OVER w AS total, row_number() OVER w AS n FROM ("
    "   SELECT seq, length(payload) AS len FROM outbox WHERE seq > ?1 ORDER BY seq LIMIT ?2)"
    "  WINDOW w AS (ORDER BY seq ROWS UNBOUNDED PRECEDING))"
    " WHERE total <= ?3 OR n = 1)"
    " ORDER BY seq"
)
SOURCES_KEPT: Final = 10_000  # sources cached before an empty outbox forgets them
_CONFIRM_SQL: Final = "DELETE FROM outbox WHERE seq BETWEEN ? AND ? RETURNING source_id, length(payload)"


def seq_ranges(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Runs of consecutive seqs as (first, last), ascending; duplicates are
    merged.  A run holds only the seqs given, so ``DELETE ... BETWEEN`` over
    the runs deletes exactly those (a whole read batch is one run, or a few
    where drops left gaps; the lanes of the forwarder confirm interleaved
    subsets, see forward.py)."""
    out: list[tuple[int, int]] = []
    first = last = -2
    for s in sorted(seqs):
        if s == last + 1:
            last = s
        elif s != last:
            if last >= 0:
                out.append((first, last))
            first = last = s
    if last >= 0:
        out.append((first, last))
    return out


class Reader(Part):
    """The forwarder's side; owns the epoch of the message ids (the outbox
    sets it when it loads the file)."""

    def __init__(
        self,
        db: Database,
        settings: BufferSettings,
        metrics: Metrics,
        *,
        gateway_id: str,
        handover: Handover,
        backlog: Backlog,
        catalog: Catalog,
        devices: Devices,
    ) -> None:
        super().__init__(db, settings, metrics)
        self._gateway_id = gateway_id
        self._gateway_hash = gateway_hash32(gateway_id)
        self._handover = handover
        self._backlog = backlog
        self._catalog = catalog
        self._devices = devices
        self.epoch = 0

    async def wait_for_data(self, timeout: float | None = None) -> bool:
        if self._backlog.records > 0:
            return True
        self._backlog.data_available.clear()
        try:
            await wait_for(self._backlog.data_available.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def wait_for_more(self, timeout: float | None = None) -> bool:
        """True once a commit added records since the last `read_batch`
        began (at once when one did); False after `timeout`.  A reader that
        reads ahead of its deletes (the forwarder) cannot use `records` to
        tell whether anything unread waits."""
        try:
            await wait_for(self._backlog.data_available.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def read_batch(self, max_records: int, max_bytes: int, after: int = 0) -> list[OutboundRecord]:
        """The oldest records with seq > `after`, in seq order, up to the
        limits (at least one when any waits)."""
        self._backlog.data_available.clear()  # before the read: a commit from now on sets it again
        # `payload_high` bounds every payload in the outbox: with it, the plain
        # read cannot load more than max_bytes either.
        if max_records * self._backlog.payload_high <= max_bytes:
            rows = await self._db.fetchall(_READ_BATCH_SMALL, (after, max_records))  # one round trip
        else:
            rows = await self._db.fetchall(_READ_BATCH, (after, max_records, max_bytes))
        out: list[OutboundRecord] = []
        append = out.append
        high = (self._gateway_hash << 96) | (self.epoch << 64)
        gw = self._gateway_id
        names = self._catalog.source_names
        qos = _QOS
        for seq, sid, flags, recv, dseq, payload in rows:
            stream, itopic, pkey, topic = names[sid]
            # One dict display per record (no per-key stores); the strings
            # of qos and retain are shared.
            if dseq is None:
                headers = {
                    HEADER_MQTT_TOPIC: topic,
                    HEADER_QOS: qos[flags & 3],
                    HEADER_RETAIN: "1" if flags & 4 else "0",
                    HEADER_GATEWAY: gw,
                    HEADER_RECEIVED_US: recv,
                }
            else:
                headers = {
                    HEADER_MQTT_TOPIC: topic,
                    HEADER_QOS: qos[flags & 3],
                    HEADER_RETAIN: "1" if flags & 4 else "0",
                    HEADER_GATEWAY: gw,
                    HEADER_RECEIVED_US: recv,
                    HEADER_DEVICE_SEQ: dseq,
                }
            append(OutboundRecord(seq, high | seq, stream, itopic, pkey, payload, headers))
        return out

    async def confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None) -> int:
        """Delete what Iggy confirmed: every record of `batch` (any set of
        records, not necessarily adjacent), or only its `confirmed` seqs.
        Exactly those rows go: the delete runs over runs of consecutive seqs
        (`seq_ranges`), never over a span that could hold an unconfirmed
        record."""
        async with self._lock:
            return await self._confirm(batch, confirmed)

    async def _confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None) -> int:
        if not batch:
            return 0
        gone = batch if confirmed is None else [r for r in batch if r.seq in confirmed]
        if not gone:
            return 0
        ranges = seq_ranges([r.seq for r in gone])
        await self._db.synchronous("NORMAL")
        # RETURNING: exactly the rows deleted (not those drop_oldest took while
        # they were in flight), for the per-device accounting (devices.py).
        if len(ranges) == 1:
            # One statement is its own transaction (autocommit): one round trip
            # to the SQLite thread instead of BEGIN / DELETE / COMMIT.
            gone_rows = list(await self._conn.execute_fetchall(_CONFIRM_SQL, ranges[0]))
        else:
            gone_rows = []
            async with self._db.transaction():
                for rng in ranges:
                    gone_rows += await self._conn.execute_fetchall(_CONFIRM_SQL, rng)
        deleted = len(gone_rows)
        if deleted:
            names = self._catalog.source_names
            row_gone = self._devices.row_gone
            freed = 0
            for sid, size in gone_rows:
                acc = size + len(names[sid][3]) + ROW_OVERHEAD
                freed += acc
                row_gone(sid, acc)
            self._backlog.records -= deleted
            self._backlog.bytes -= freed
        if self._backlog.records == 0 and self._handover.pending_bytes == 0:
            self._backlog.payload_high = 0  # empty: the next payloads set it again
        if self._backlog.records == 0 and len(self._catalog.source_ids) > SOURCES_KEPT:
            await self._forget_sources()
        self._backlog.update_gauges()
        return deleted

    async def _forget_sources(self) -> None:
        """The outbox just emptied: forget the devices with nothing pending
        and delete their sources, so a stream of ever new MQTT topics does
        not keep its sources until a bound needs the room (lock held)."""
        self._devices.idle_maybe = True
        self._devices.forget_idle_devices()
        await self._devices.delete_doomed()
        self._devices.doomed.clear()

    async def oldest_received_us(self) -> int | None:
        rows = await self._db.fetchall("SELECT received_us FROM outbox ORDER BY seq LIMIT 1")
        return None if not rows else int(rows[0][0])

    async def refresh_age_gauge(self) -> None:
        oldest = await self.oldest_received_us()
        self._metrics.backlog_oldest_age.set(0 if oldest is None else max(0.0, time.time() - oldest / 1e6))
