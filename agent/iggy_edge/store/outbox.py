"""The outbox put together: its parts (see base.py for who owns what) and
their life cycle (open, load, start, close); the methods the stages call
forward to the part that does the job."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

from ..config import BufferSettings
from ..metrics import Metrics
from ..records import OutboundRecord, Route
from ..routing import Rejected
from ..timeouts import wait_for
from .base import Backlog, Handover
from .bounds import Bounds
from .commit import GroupCommit
from .db import Database, StoreError
from .dead import DeadLetters
from .devices import Devices
from .reader import Reader
from .recovery import Event, StoreUnavailable, events_from_json, open_loaded
from .schema import DEAD_TOTALS_SQL, OUTBOX_LOAD_SQL, ROW_OVERHEAD
from .sources import Catalog

log = logging.getLogger(__name__)


class Outbox:
    """Durable, bounded outbox with group commit.  See the package docstring."""

    def __init__(self, db: Database, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> None:
        self._db = db
        self._conn = db.conn
        self._lock = db.lock
        self._metrics = metrics
        self.catalog = Catalog()
        self.backlog = Backlog(metrics)
        self.handover = Handover()
        self.devices = Devices(db, settings, metrics, self.catalog)
        self.bounds = Bounds(
            db, settings, metrics, backlog=self.backlog, devices=self.devices, catalog=self.catalog
        )
        self.dead = DeadLetters(db, settings, metrics, self.handover)
        self.commit = GroupCommit(
            db,
            settings,
            metrics,
            handover=self.handover,
            backlog=self.backlog,
            catalog=self.catalog,
            devices=self.devices,
            bounds=self.bounds,
            dead=self.dead,
        )
        self.reader = Reader(
            db,
            settings,
            metrics,
            gateway_id=gateway_id,
            handover=self.handover,
            backlog=self.backlog,
            catalog=self.catalog,
            devices=self.devices,
        )
        self._parts = (self.devices, self.bounds, self.dead, self.commit, self.reader)
        # ingest's hot path: the parts' own methods, no forwarding call
        self.submit = self.commit.submit
        self.take = self.commit.take
        self.seen = self.commit.seen
        self.copy_of = self.commit.copy_of
        self.admit: Callable[[Route, str], Rejected | None] = self.devices.admit
        self.enqueue_dead_letter = self.dead.enqueue_dead_letter
        self.dead_letter = self.dead.dead_letter  # stages.DeadLetterSink
        self.recovery: list[Event] = []

    # -- life cycle -------------------------------------------------------

    @classmethod
    async def open(cls, path: Path, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> Outbox:
        """Open and load the buffer (`recovery.open_loaded`: a confirmed
        corruption is salvaged into a fresh file; anything else raises
        `StoreError`, `StoreUnavailable` when the disk failed)."""

        async def load(db: Database) -> Outbox:
            box = cls(db, settings, gateway_id, metrics)
            await box._load()
            return box

        return await open_loaded(path, metrics, load)

    @classmethod
    async def open_when_possible(
        cls,
        path: Path,
        settings: BufferSettings,
        gateway_id: str,
        metrics: Metrics,
        *,
        stop: asyncio.Event,
        on_failure: Callable[[StoreError | None], None] = lambda _e: None,
        max_delay_s: float = 30.0,
    ) -> Outbox | None:
        """`open`, retried with capped backoff while the disk fails
        (`StoreUnavailable`: full, I/O error): the file stays in place,
        nothing is acknowledged meanwhile (ingest is not started, so the broker
        keeps the messages) and the agent resumes once the disk works again.
        `on_failure(err)` reports each failure and `on_failure(None)` the
        success.  None when `stop` is set first; other errors raise."""
        attempt = 0
        while not stop.is_set():
            try:
                box = await cls.open(path, settings, gateway_id, metrics)
            except StoreUnavailable as e:
                on_failure(e)
                delay = min(max_delay_s, 0.5 * 2**attempt)
                attempt += 1
                log.error(
                    "store=failed: %s; nothing is acknowledged (the broker keeps the messages);"
                    " retry %d in %.1fs",
                    e,
                    attempt,
                    delay,
                )
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), delay)
                continue
            on_failure(None)
            if attempt:
                log.warning("buffer %s opened after %d failed attempts", path, attempt)
            return box
        return None

    async def _load(self) -> None:
        epoch = await self._meta("epoch")
        if epoch is None:
            epoch = str(secrets.randbits(32))
            await self._conn.execute("INSERT INTO meta(key, value) VALUES ('epoch', ?)", (epoch,))
        self.reader.epoch = int(epoch)
        for rid, stream, topic in await self._db.fetchall("SELECT id, stream, topic FROM routes"):
            self.catalog.add_route(rid, stream, topic)
        await self.devices.load()
        dead = await self._db.fetchone(DEAD_TOTALS_SQL)
        self.dead.dead_count, self.dead.dead_bytes = int(dead[0]), int(dead[1]) + ROW_OVERHEAD * int(dead[0])
        row = await self._db.fetchone(OUTBOX_LOAD_SQL)
        assert row is not None
        backlog = self.backlog
        backlog.records = int(row[0])
        backlog.bytes = int(row[1]) + ROW_OVERHEAD * backlog.records
        backlog.payload_high = int(row[2])
        await self.commit.load_recent()
        self.recovery = await self._recovery_events()
        backlog.update_gauges()
        self._metrics.dead_letter_bytes.set(self.dead.dead_bytes)
        if backlog.records:
            backlog.data_available.set()

    async def _recovery_events(self) -> list[Event]:
        return events_from_json(await self._meta("recovery"))

    def reconfigure(self, settings: BufferSettings) -> None:
        """New bounds, TTL and dead-letter limits (a reload, reload.py): the
        next commit enforces them; the file, its synchronous level and the
        commit cadence need a restart and are not in a reload's changes."""
        for part in self._parts:
            part.reconfigure(settings)

    @property
    def attention(self) -> str:
        """What an operator must look at ("" when nothing): recovery events
        not yet acknowledged (`iggy-edge buffer ack-salvage`)."""
        open_events = [e for e in self.recovery if not e.acknowledged]
        parts = []
        for e in open_events:
            if e.kind == "salvaged":
                parts.append(
                    f"damaged buffer moved aside to {e.aside}: {e.salvaged} records salvaged, "
                    f"{e.unreadable} unreadable"
                )
            else:
                parts.append(f"damaged WAL copied to {e.aside}: up to {e.frames_lost} frames may be missing")
        if parts:
            parts.append("acknowledge with: iggy-edge buffer ack-salvage")
        return "; ".join(parts)

    async def refresh_age_gauge(self) -> None:
        await self.reader.refresh_age_gauge()
        async with self._lock:
            self.recovery = await self._recovery_events()  # an operator may have acknowledged

    def start(self) -> None:
        self.handover.committer = asyncio.create_task(self.commit.commit_loop(), name="outbox-commit")

    async def close(self) -> None:
        """Commit what is pending, stop the committer and close the file."""
        self.handover.closed = True
        self.handover.wakeup.set()
        if self.handover.committer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.handover.committer
        await self._db.close(checkpoint=True)

    # -- what the stages call, forwarded to the part that does it ---------------

    @property
    def pending_count(self) -> int:
        return self.commit.pending_count

    @property
    def pending_bytes(self) -> int:
        """Payload bytes of records and dead letters waiting for their commit."""
        return self.handover.pending_bytes

    async def wait_pending_below(self, limit: int, *, max_bytes: int | None = None) -> None:
        await self.commit.wait_pending_below(limit, max_bytes=max_bytes)

    def backlog_by_device(self) -> dict[str, tuple[int, int]]:
        return self.devices.backlog_by_device()

    async def expire(self, now_us: int | None = None) -> int:
        return await self.bounds.expire(now_us)

    async def wait_for_data(self, timeout: float | None = None) -> bool:
        return await self.reader.wait_for_data(timeout)

    async def wait_for_more(self, timeout: float | None = None) -> bool:
        return await self.reader.wait_for_more(timeout)

    async def read_batch(self, max_records: int, max_bytes: int, after: int = 0) -> list[OutboundRecord]:
        return await self.reader.read_batch(max_records, max_bytes, after)

    async def confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None) -> int:
        return await self.reader.confirm(batch, confirmed)

    async def oldest_received_us(self) -> int | None:
        return await self.reader.oldest_received_us()

    async def get_meta(self, key: str) -> str | None:
        """A value of the meta table (ingest keeps its session flag there)."""
        async with self._db.lock:
            return await self._meta(key)

    async def set_meta(self, key: str, value: str) -> None:
        async with self._db.write() as conn:
            await conn.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    async def _meta(self, key: str) -> str | None:
        row = await self._db.fetchone("SELECT value FROM meta WHERE key = ?", (key,))
        return None if row is None else str(row[0])

    # (last: a property named `bytes` shadows the type in the annotations after it)

    @property
    def records(self) -> int:
        return self.backlog.records

    @property
    def bytes(self) -> int:
        return self.backlog.bytes

    @property
    def payload_high(self) -> int:
        return self.backlog.payload_high

    @property
    def dead_count(self) -> int:
        return self.dead.dead_count

    @property
    def dead_bytes(self) -> int:
        return self.dead.dead_bytes

    @property
    def epoch(self) -> int:
        return self.reader.epoch
