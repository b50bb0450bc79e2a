"""How the outbox is put together: parts that own their state, joined by
explicit references (outbox.py builds them).

=============  ==========================================  =====================
part           owns                                        is given
=============  ==========================================  =====================
`Catalog`      route and source ids (sources.py)           --
`Devices`      per-device accounting (devices.py)          catalog
`Bounds`       nothing: the policy (bounds.py)             backlog, devices, catalog
`DeadLetters`  dead-letter groups, count, bytes (dead.py)  handover
`GroupCommit`  the open group, redelivery window           handover, backlog, catalog,
               (commit.py)                                 devices, bounds, dead letters
`Reader`       the epoch; reads and confirms (reader.py)   handover, backlog, catalog, devices
=============  ==========================================  =====================

Two small objects here are given to more than one part, because each is
one fact that several parts change: `Backlog`, the outbox table's totals
(the commit adds, a confirm, an expiry or a drop takes away), and
`Handover`, the channel from the synchronous submitters (records, dead
letters) to the committer task: payload bytes waiting, the wake-up event
and the committer itself.  Every part also holds the `Part` references:
the database, the settings (each part's `reconfigure`), metrics and the
rate-limited log -- references, no state.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import zlib

from ..config import BufferSettings
from ..logs import RateLimitedLog
from ..metrics import Metrics
from .db import Database

log = logging.getLogger("iggy_edge.store")


# The redelivery window's key of a record (`recent_key`).
RecentKey = tuple[str, int]


def recent_key(mqtt_topic: str, device_seq: int, crc: int) -> RecentKey:
    """The redelivery window's key for (topic, device sequence, payload CRC32):
    exact (`crc` takes the low 32 bits, so no two triples share a key), with
    the topic interned so the entries of one device share one string."""
    return sys.intern(mqtt_topic), device_seq << 32 | crc


def redelivery_key(mqtt_topic: str, qos: int, device_seq: int | None, payload: bytes) -> RecentKey | None:
    """The key a record is recognised by when it comes again, or None when
    it is not recognised: only QoS1/2 comes back as a broker redelivery, and
    only a record with a device sequence can be told from a new one.  Ingest
    computes it once per message (`Incoming.key`): the payload's CRC is
    taken here only."""
    if device_seq is None or not qos:
        return None
    return sys.intern(mqtt_topic), device_seq << 32 | zlib.crc32(payload)


class Backlog:
    """The outbox table's totals: records, accounted bytes, and at least the
    largest payload in the outbox or on its way there (a high-water mark
    since the outbox was last empty: read_batch uses it to keep a batch read
    within its byte limit).  `data_available` is set whenever a commit added
    records."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.records = 0
        self.bytes = 0
        self.payload_high = 0
        self.data_available = asyncio.Event()

    def update_gauges(self) -> None:
        self._metrics.backlog_records.set(self.records)
        self._metrics.backlog_bytes.set(self.bytes)


class Handover:
    """From the submitters (records, dead letters; synchronous) to the
    committer task."""

    def __init__(self) -> None:
        self.pending_bytes = 0  # payload bytes handed over, not yet committed
        self.progress = asyncio.Event()  # set whenever a commit releases pending bytes
        self.wakeup = asyncio.Event()
        self.closed = False
        self.committer: asyncio.Task[None] | None = None

    def committer_running(self) -> bool:
        return self.committer is not None and not self.committer.done()

    def release(self, nbytes: int) -> None:
        self.pending_bytes -= nbytes
        self.progress.set()


class Part:
    """The references every part holds (no state of its own)."""

    def __init__(self, db: Database, settings: BufferSettings, metrics: Metrics) -> None:
        self._db = db
        self._conn = db.conn
        # Every statement of the running outbox goes through this lock (see
        # db.py): the committer, the forwarder, ingest's dead letters and
        # housekeeping share one connection.
        self._lock = db.lock
        self._settings = settings
        self._metrics = metrics
        self._sync_insert = settings.synchronous.upper()
        self._limited = RateLimitedLog(log)

    def reconfigure(self, settings: BufferSettings) -> None:
        """New bounds, TTL and dead-letter limits (a reload)."""
        self._settings = settings
