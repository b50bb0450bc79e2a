"""Dead letters: messages that cannot be routed, kept with their reason and
bounded by count (`max_dead_letters`) and by accounted bytes
(`max_dead_letter_bytes`: payload + topic + ROW_OVERHEAD, its own bound
beside `max_bytes`), oldest first, written in groups.  An oversize payload
can never be replayed, so its letter keeps only its first
OVERSIZE_KEPT_BYTES, with the full length (`payload_size`) and its SHA-256
in `detail`; other letters keep up to max_payload_bytes (replayable).

API (ingest's side)
-------------------
``enqueue_dead_letter(...) -> Future[None]`` is synchronous, like `submit`:
the letter joins the open dead-letter group (its payload already cut to
``max_payload_bytes``, so an oversize payload is not held whole) and the
group's future is returned; the committer task writes each group in one
transaction and resolves the future (or sets a `StoreError`; the exception
is marked retrieved, so a fire-and-forget QoS0 caller may drop the future).
A group closes at `DEAD_GROUP_MAX` letters or `DEAD_GROUP_MAX_BYTES` payload
bytes; later letters open the next group, so one flood does not become one
huge transaction.  ``dead_letter(...)`` enqueues and awaits (the old API).

``pending_bytes`` is the payload bytes of records and dead letters handed
over and not yet committed (or failed); with ``pending_count`` and
``wait_pending_below(limit, max_bytes=...)`` ingest bounds the work it holds
by bytes as well as by count.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

from ..config import BufferSettings
from ..metrics import Metrics
from .base import Handover, Part
from .db import Database, StoreError
from .schema import ROW_OVERHEAD

log = logging.getLogger(__name__)

DEAD_GROUP_MAX: Final = 1000
DEAD_GROUP_MAX_BYTES: Final = 4 * 1024 * 1024
OVERSIZE_KEPT_BYTES: Final = 1024  # of an oversize payload, the prefix a dead letter keeps


@dataclass
class _DeadGroup:
    """Dead letters committed together."""

    rows: list[tuple[Any, ...]] = field(default_factory=list)
    nbytes: int = 0
    done: asyncio.Future[None] | None = None


class DeadLetters(Part):
    """The dead letters: the groups waiting for their commit, and the count
    and accounted bytes of those in the table.  Committed by the committer
    task (commit.py calls `commit_groups`), or here when none runs."""

    def __init__(self, db: Database, settings: BufferSettings, metrics: Metrics, handover: Handover) -> None:
        super().__init__(db, settings, metrics)
        self._handover = handover
        self.groups: deque[_DeadGroup] = deque()
        self.dead_count = 0
        self.dead_bytes = 0

    def enqueue_dead_letter(
        self,
        *,
        mqtt_topic: str | bytes,
        payload: bytes,
        qos: int,
        retain: bool,
        reason: str,
        detail: str,
        received_us: int | None = None,
    ) -> asyncio.Future[None]:
        """Queue a dead letter for the next dead-letter group commit
        (synchronous) and return that commit's future.  See the module
        docstring."""
        loop = asyncio.get_running_loop()
        topic_b = mqtt_topic.encode() if isinstance(mqtt_topic, str) else mqtt_topic
        kept = payload[: self._settings.max_payload_bytes]
        if reason == "oversize" and len(payload) > OVERSIZE_KEPT_BYTES:
            # Never replayable (longer than max_payload_bytes): a prefix to look
            # at, with the full length (payload_size) and a hash to match it.
            kept = payload[:OVERSIZE_KEPT_BYTES]
            digest = hashlib.sha256(payload).hexdigest()
            detail = f"{detail}; kept the first {len(kept)} bytes, sha256 {digest}"
        row = (
            received_us or time.time_ns() // 1000,
            topic_b[:1024],
            qos,
            int(retain),
            reason,
            detail,
            kept,
            len(payload),
        )
        groups = self.groups
        if not groups or len(groups[-1].rows) >= DEAD_GROUP_MAX or groups[-1].nbytes >= DEAD_GROUP_MAX_BYTES:
            groups.append(_DeadGroup(done=loop.create_future()))
        group = groups[-1]
        group.rows.append(row)
        size = len(kept) + len(topic_b[:1024])
        group.nbytes += size
        self._handover.pending_bytes += size
        self._handover.wakeup.set()
        assert group.done is not None
        return group.done

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
        fut = self.enqueue_dead_letter(
            mqtt_topic=mqtt_topic,
            payload=payload,
            qos=qos,
            retain=retain,
            reason=reason,
            detail=detail,
            received_us=received_us,
        )
        if not self._handover.committer_running():
            await self.commit_groups()  # no committer task (not started): write it here
        await fut

    async def commit_groups(self) -> None:
        """Commit every closed or open dead-letter group, oldest first."""
        while self.groups:
            group = self.groups.popleft()
            await self._commit_dead_group(group)

    async def _trim_dead(self, count: int, nbytes: int) -> tuple[int, int]:
        """Inside the transaction: delete the oldest letters until both
        `max_dead_letters` and `max_dead_letter_bytes` hold; the totals left."""
        s = self._settings
        while count > s.max_dead_letters or nbytes > s.max_dead_letter_bytes:
            need = max(count - s.max_dead_letters, 1)
            async with self._conn.execute(
                "SELECT id, length(payload) + length(mqtt_topic) FROM dead_letters ORDER BY id LIMIT ?",
                (max(need, 64),),
            ) as cur:
                oldest = list(await cur.fetchall())
            if not oldest:
                break
            last = oldest[-1][0]
            for dl_id, size in oldest:
                count -= 1
                nbytes -= int(size) + ROW_OVERHEAD
                last = dl_id
                if count <= s.max_dead_letters and nbytes <= s.max_dead_letter_bytes:
                    break
            await self._conn.execute("DELETE FROM dead_letters WHERE id <= ?", (last,))
        return count, nbytes

    async def _commit_dead_group(self, group: _DeadGroup) -> None:
        try:
            async with self._lock:
                await self._db.synchronous(self._sync_insert)
                async with self._db.transaction() as conn:
                    await conn.executemany(
                        "INSERT INTO dead_letters(received_us, mqtt_topic, qos, retain, reason, detail,"
                        " payload, payload_size) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        group.rows,
                    )
                    added = sum(len(r[1]) + len(r[6]) for r in group.rows) + ROW_OVERHEAD * len(group.rows)
                    count, nbytes = await self._trim_dead(
                        self.dead_count + len(group.rows), self.dead_bytes + added
                    )
        except (sqlite3.Error, OSError) as e:
            self._metrics.store_errors.inc()
            log.error("dead-letter commit of %d letters failed: %s", len(group.rows), e)
            self._handover.release(group.nbytes)
            if group.done is not None and not group.done.done():
                group.done.set_exception(StoreError(f"dead letter not stored: {e}"))
                group.done.exception()  # mark retrieved: each waiter re-raises it
            return
        self._handover.release(group.nbytes)
        self.dead_count, self.dead_bytes = count, nbytes
        self._metrics.dead_letter_bytes.set(nbytes)
        by_reason: dict[str, list[tuple[Any, ...]]] = {}
        for row in group.rows:
            by_reason.setdefault(row[4], []).append(row)
        for reason, rows in by_reason.items():
            self._metrics.dead_letters.labels(reason).inc(len(rows))
            last = rows[-1]
            self._limited.warning(
                f"dead:{reason}",
                "dead letter (%s): topic %r: %s (%d in this commit)",
                reason,
                last[1][:200],
                last[5],
                len(rows),
            )
        if group.done is not None and not group.done.done():
            group.done.set_result(None)
