"""Dead letters: messages that cannot be routed, kept with their reason and
bounded by count (oldest first)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .base import OutboxBase
from .db import StoreError


@dataclass(slots=True)
class DeadLetter:
    """A message that cannot be routed, with its reason.  `payload` may be
    cut to max_payload_bytes already; `payload_size` is the original size."""

    mqtt_topic: str | bytes
    payload: bytes
    payload_size: int
    qos: int
    retain: bool
    reason: str
    detail: str
    received_us: int


class DeadLetters(OutboxBase):
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
        await self.dead_letters(
            [
                DeadLetter(
                    mqtt_topic,
                    payload,
                    len(payload),
                    qos,
                    retain,
                    reason,
                    detail,
                    received_us or time.time_ns() // 1000,
                )
            ]
        )

    async def dead_letters(self, items: Sequence[DeadLetter]) -> None:
        """Store a group of dead letters in one transaction (a flood of bad
        messages costs one commit per group, not one per message)."""
        cap = self._settings.max_payload_bytes
        rows = [
            (
                d.received_us,
                (d.mqtt_topic.encode() if isinstance(d.mqtt_topic, str) else d.mqtt_topic)[:1024],
                d.qos,
                int(d.retain),
                d.reason,
                d.detail,
                d.payload[:cap],
                d.payload_size,
            )
            for d in items
        ]
        try:
            async with self._lock:
                await self._db.synchronous(self._sync_insert)
                async with self._db.transaction() as conn:
                    await conn.executemany(
                        "INSERT INTO dead_letters(received_us, mqtt_topic, qos, retain, reason, detail,"
                        " payload, payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )
                    await conn.execute(
                        "DELETE FROM dead_letters WHERE id <= (SELECT max(id) FROM dead_letters) - ?",
                        (self._settings.max_dead_letters,),
                    )
        except (sqlite3.Error, OSError) as e:
            self._metrics.store_errors.inc()
            raise StoreError(f"dead letter not stored: {e}") from e
        for row, d in zip(rows, items, strict=True):
            self._metrics.dead_letters.labels(d.reason).inc()
            self._limited.warning(
                f"dead:{d.reason}", "dead letter (%s): topic %r: %s", d.reason, row[1][:200], d.detail
            )
