"""The state the outbox's jobs share (one object, split by job over mixins:
commit.py, reader.py, bounds.py, dead.py; outbox.py puts them together)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import BufferSettings
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..records import gateway_hash32
from .db import Database
from .schema import COUNT_DROP_SQL
from .sources import Catalog

if TYPE_CHECKING:
    from .devices import Device

log = logging.getLogger("iggy_edge.store")


def recent_key(mqtt_topic: str, device_seq: int, crc: int) -> tuple[str, int]:
    """The redelivery window's key for (topic, device sequence, payload CRC32):
    exact (`crc` takes the low 32 bits, so no two triples share a key), with
    the topic interned so the entries of one device share one string."""
    return sys.intern(mqtt_topic), device_seq << 32 | crc


@dataclass
class _DeadGroup:
    """Dead letters committed together (dead.py)."""

    rows: list[tuple[Any, ...]] = field(default_factory=list)
    nbytes: int = 0
    done: asyncio.Future[None] | None = None


class OutboxBase:
    """Fields and small helpers used by more than one job."""

    def __init__(self, db: Database, settings: BufferSettings, gateway_id: str, metrics: Metrics) -> None:
        self._db = db
        self._conn = db.conn
        self._settings = settings
        self._gateway_id = gateway_id
        self._gateway_hash = gateway_hash32(gateway_id)
        self._metrics = metrics
        self._sync_insert = settings.synchronous.upper()
        self._limited = RateLimitedLog(log)
        self._epoch = 0
        self._catalog = Catalog()  # routes and sources, their ids (sources.py)
        # per-device bounds (devices.py): device -> its state, source id -> its
        # rows, sources forgotten and not yet deleted from the table
        self._devices: dict[str, Device] = {}
        self._src_rows: dict[int, int] = {}
        self._doomed: set[int] = set()
        self._idle_maybe = False
        # dead letters in the table: count and accounted bytes (dead.py)
        self.dead_count = 0
        self.dead_bytes = 0
        # Every statement of the running outbox goes through this lock (see
        # db.py): the committer, the forwarder, ingest's dead letters and
        # housekeeping share one connection.
        self._lock = db.lock
        self._wakeup = asyncio.Event()
        self._data_available = asyncio.Event()
        self._closed = False
        # Insertion-ordered and bounded.  An OrderedDict because trimming a plain
        # dict from the front with next(iter(d)) rescans its deleted slots: that
        # was 10 us per record at 20k entries, the largest cost in _insert.
        # Keys are `recent_key`s: 169 bytes an entry against 274 for a
        # (topic, seq, crc) triple with its own topic string (2 MB less at 20k).
        self._recent: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._recent_count = 0
        self.records = 0
        self.bytes = 0
        # At least the largest payload in the outbox or on its way there (a
        # high-water mark since the outbox was last empty): read_batch uses
        # it to keep a batch read within its byte limit.
        self.payload_high = 0
        self._committer: asyncio.Task[None] | None = None
        # payload bytes handed over (records and dead letters), not yet committed
        self._pending_bytes = 0
        self._progress = asyncio.Event()  # set whenever a commit releases pending bytes
        self._dead_groups: deque[_DeadGroup] = deque()

    def _committer_running(self) -> bool:
        return self._committer is not None and not self._committer.done()

    def _release(self, nbytes: int) -> None:
        self._pending_bytes -= nbytes
        self._progress.set()

    def _update_gauges(self) -> None:
        self._metrics.backlog_records.set(self.records)
        self._metrics.backlog_bytes.set(self.bytes)
        self._metrics.dead_letter_bytes.set(self.dead_bytes)

    async def _count_drop(self, reason: str, n: int) -> None:
        """Add `n` to the persistent drop counter (inside the caller's transaction)."""
        await self._conn.execute(COUNT_DROP_SQL, (reason, n))
