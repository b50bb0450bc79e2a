"""Dead letters: messages that cannot be routed, kept with their reason and
bounded by count (oldest first)."""

from __future__ import annotations

import sqlite3
import time

from .base import OutboxBase
from .db import StoreError


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
        topic_b = mqtt_topic.encode() if isinstance(mqtt_topic, str) else mqtt_topic
        cap = self._settings.max_payload_bytes
        try:
            async with self._lock:
                await self._db.synchronous(self._sync_insert)
                async with self._db.transaction() as conn:
                    await conn.execute(
                        "INSERT INTO dead_letters(received_us, mqtt_topic, qos, retain, reason, detail,"
                        " payload, payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
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
                    await conn.execute(
                        "DELETE FROM dead_letters WHERE id <= (SELECT max(id) FROM dead_letters) - ?",
                        (self._settings.max_dead_letters,),
                    )
        except (sqlite3.Error, OSError) as e:
            self._metrics.store_errors.inc()
            raise StoreError(f"dead letter not stored: {e}") from e
        self._metrics.dead_letters.labels(reason).inc()
        self._limited.warning(
            f"dead:{reason}", "dead letter (%s): topic %r: %s", reason, topic_b[:200], detail
        )
