"""The forwarder's side of the outbox: read the oldest batch, delete what the
uplink confirmed."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..records import (
    HEADER_DEVICE_SEQ,
    HEADER_GATEWAY,
    HEADER_MQTT_TOPIC,
    HEADER_QOS,
    HEADER_RECEIVED_US,
    HEADER_RETAIN,
    OutboundRecord,
)
from ..timeouts import wait_for
from .base import OutboxBase
from .schema import accounted_bytes


class ReadConfirm(OutboxBase):
    async def wait_for_data(self, timeout: float | None = None) -> bool:
        if self.records > 0:
            return True
        self._data_available.clear()
        try:
            await wait_for(self._data_available.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def read_batch(self, max_records: int, max_bytes: int) -> list[OutboundRecord]:
        """The oldest records, in seq order, up to the limits (at least one)."""
        rows = await self._db.fetchall(  # one round trip to the SQLite thread
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
        await self._db.synchronous("NORMAL")
        deleted_before = self._conn.total_changes
        if confirmed is None:
            # One statement is its own transaction (autocommit): one round trip
            # to the SQLite thread instead of BEGIN / DELETE / COMMIT.
            await self._conn.execute_fetchall(
                "DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (batch[0].seq, batch[-1].seq)
            )
        else:
            async with self._db.transaction():
                await self._conn.executemany("DELETE FROM outbox WHERE seq = ?", [(r.seq,) for r in gone])
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

    async def oldest_received_us(self) -> int | None:
        rows = await self._db.fetchall("SELECT received_us FROM outbox ORDER BY seq LIMIT 1")
        return None if not rows else int(rows[0][0])

    async def refresh_age_gauge(self) -> None:
        oldest = await self.oldest_received_us()
        self._metrics.backlog_oldest_age.set(0 if oldest is None else max(0.0, time.time() - oldest / 1e6))
