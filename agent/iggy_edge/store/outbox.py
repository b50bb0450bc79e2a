"""The outbox put together: life cycle (open, load, start, close) over the
jobs in commit.py, reader.py, bounds.py and dead.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from pathlib import Path

from ..config import BufferSettings
from ..metrics import Metrics
from ..timeouts import wait_for
from .base import recent_key
from .commit import GroupCommit, _Group
from .db import Database, StoreError
from .reader import ReadConfirm
from .recovery import Event, StoreUnavailable, events_from_json, open_loaded
from .schema import DEAD_TOTALS_SQL, OUTBOX_LOAD_SQL, RECENT_WINDOW, ROW_OVERHEAD

log = logging.getLogger(__name__)


class Outbox(GroupCommit, ReadConfirm):
    """Durable, bounded outbox with group commit.  See the package docstring."""

    def __init__(self, db: Database, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> None:
        super().__init__(db, settings, gateway_id, metrics)
        self._pending = _Group()
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
        self._epoch = int(epoch)
        for rid, stream, topic in await self._db.fetchall("SELECT id, stream, topic FROM routes"):
            self._catalog.add_route(rid, stream, topic)
        await self._load_devices()
        dead = await self._db.fetchone(DEAD_TOTALS_SQL)
        self.dead_count, self.dead_bytes = int(dead[0]), int(dead[1]) + ROW_OVERHEAD * int(dead[0])
        row = await self._db.fetchone(OUTBOX_LOAD_SQL)
        assert row is not None
        self.records = int(row[0])
        self.bytes = int(row[1]) + ROW_OVERHEAD * self.records
        self.payload_high = int(row[2])
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
        self.recovery = await self._recovery_events()
        self._update_gauges()
        if self.records:
            self._data_available.set()

    async def _recovery_events(self) -> list[Event]:
        return events_from_json(await self._meta("recovery"))

    def reconfigure(self, settings: BufferSettings) -> None:
        """New bounds, TTL and dead-letter limits (a reload, reload.py): the
        next commit enforces them; the file, its synchronous level and the
        commit cadence need a restart and are not in a reload's changes."""
        self._settings = settings

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
        await super().refresh_age_gauge()
        async with self._lock:
            self.recovery = await self._recovery_events()  # an operator may have acknowledged

    def start(self) -> None:
        self._committer = asyncio.create_task(self._commit_loop(), name="outbox-commit")

    async def close(self) -> None:
        """Commit what is pending, stop the committer and close the file."""
        self._closed = True
        self._wakeup.set()
        if self._committer is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._committer
        await self._db.close(checkpoint=True)

    @property
    def epoch(self) -> int:
        return self._epoch

    def seen(self, mqtt_topic: str, device_seq: int, crc: int) -> bool:
        """Was a record with this topic, device sequence and payload CRC
        committed recently?  (Used for broker redeliveries only.)"""
        return recent_key(mqtt_topic, device_seq, crc) in self._recent

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
