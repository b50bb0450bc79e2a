"""The outbox put together: life cycle (open, load, start, close) over the
jobs in commit.py, reader.py, bounds.py and dead.py."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import aiosqlite

from ..config import BufferSettings
from ..metrics import Metrics
from .commit import GroupCommit, _Group
from .db import Database, StoreError
from .dead import DeadLetters
from .reader import ReadConfirm
from .schema import RECENT_WINDOW, ROW_OVERHEAD, open_database


class Outbox(GroupCommit, ReadConfirm, DeadLetters):
    """Durable, bounded outbox with group commit.  See the package docstring."""

    def __init__(self, db: Database, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> None:
        super().__init__(db, settings, gateway_id, metrics)
        self._pending = _Group()
        self._committer = None

    # -- life cycle -------------------------------------------------------

    @classmethod
    async def open(cls, path: Path, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> Outbox:
        db = await open_database(path, metrics)
        box = cls(db, settings, gateway_id, metrics)
        await box._load()
        return box

    async def _load(self) -> None:
        epoch = await self._meta("epoch")
        if epoch is None:
            epoch = str(secrets.randbits(32))
            await self._conn.execute("INSERT INTO meta(key, value) VALUES ('epoch', ?)", (epoch,))
        self._epoch = int(epoch)
        for rid, stream, topic in await self._db.fetchall("SELECT id, stream, topic FROM routes"):
            self._route_ids[(stream, topic)] = rid
            self._route_names[rid] = (stream, topic)
        row = await self._db.fetchone(
            "SELECT count(*), coalesce(sum(length(payload) + length(mqtt_topic)), 0) FROM outbox"
        )
        assert row is not None
        self.records = int(row[0])
        self.bytes = int(row[1]) + ROW_OVERHEAD * self.records
        recent = await self._db.fetchall(
            "SELECT mqtt_topic, device_seq, crc FROM ingest_recent ORDER BY seq DESC LIMIT ?",
            (RECENT_WINDOW,),
        )
        for topic, dseq, crc in reversed(recent):
            self._recent[(topic, dseq, crc)] = None
        self._recent_count = len(recent)
        self._update_gauges()
        if self.records:
            self._data_available.set()

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
    def connection(self) -> aiosqlite.Connection:
        return self._conn

    @property
    def database(self) -> Database:
        return self._db

    @property
    def epoch(self) -> int:
        return self._epoch

    def seen(self, mqtt_topic: str, device_seq: int, crc: int) -> bool:
        """Was a record with this topic, device sequence and payload CRC
        committed recently?  (Used for broker redeliveries only.)"""
        return (mqtt_topic, device_seq, crc) in self._recent

    def fail(self, err: StoreError) -> None:
        """Refuse further submissions (used when the disk is gone)."""
        self._failure = err

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
