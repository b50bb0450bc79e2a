"""Per-device bounds: distinct topics per device, devices tracked, and the
fair share of `drop_oldest`.

The device of a record is its partition key (`Route.key`): with the default
rules the device level of `edge/{device}/up/...`, which with the packaged ACL
is the device's MQTT user -- but any string a topic carries.  For each device
the outbox keeps, in memory and O(1) per record: its committed records and
accounted bytes, its sources (a source is a (route, key, MQTT topic), see
schema.py) with each source's row count, and the records it has waiting in
the open group.

* **Topics.**  A device may have `max_topics_per_device` distinct MQTT topics
  in the buffer (topics with rows, or with records waiting for their
  commit); a message on a further topic is a dead letter `too_many_topics`.
  Sources whose rows are all gone (forwarded, dropped, expired) are
  forgotten first, so a device that changes topics over time is not refused.
* **Devices.**  At most `max_devices` devices are tracked; a message of a
  further device is a dead letter `too_many_devices`, once the devices with
  nothing in the buffer have been forgotten.  Devices already tracked are
  never refused for a newcomer: under a flood of new device levels the
  devices that were there keep working.
* **Memory.**  So the sources in memory and in the table are at most
  max_devices x max_topics_per_device (32,000 with the defaults) plus the
  sources of the rows already in a file; orphaned sources are deleted from the
  table at the next commit and when the outbox opens.
* **Fairness** (`drop_oldest`, bounds.py): the records to drop are taken
  from the devices holding the largest share, down to a common level
  (water-filling), each losing its own oldest first; a device under that level
  keeps all its readings.  Finding a device's oldest rows uses the index
  `outbox_by_source`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..config import BufferSettings
from ..metrics import Metrics
from ..records import Route
from ..routing import DeadLetterReason, Rejected
from .base import Part
from .db import Database
from .schema import ROW_OVERHEAD
from .sources import ORPHANS_SQL, Catalog


@dataclass(slots=True)
class Device:
    records: int = 0  # committed rows
    bytes: int = 0  # their accounted bytes
    pending: int = 0  # reservations of groups not settled yet (one per source and group)
    topics: dict[str, int] = field(default_factory=dict)  # MQTT topic -> its sources + reservations
    sids: set[int] = field(default_factory=set)
    orphans: int = 0  # sids without a row


def water_fill(values: dict[str, int], need: int) -> dict[str, int]:
    """How much each key gives so that `need` is taken from the largest
    values first, down to a common level (ties share it).  All of every
    value when they do not add up to `need`."""
    if need <= 0:
        return {}
    items = sorted(((v, k) for k, v in values.items() if v > 0), reverse=True)
    total = 0
    for i, (v, _) in enumerate(items):
        total += v
        nxt = items[i + 1][0] if i + 1 < len(items) else 0
        k = i + 1
        if total - k * nxt >= need:
            level = max(nxt, (total - need) // k)
            quotas = {key: val - level for val, key in items[:k]}
            excess = total - k * level - need  # < k: the last ones give one less
            for _, key in items[k - excess : k]:
                quotas[key] -= 1
            return {key: q for key, q in quotas.items() if q > 0}
    return {key: v for v, key in items}


class Devices(Part):
    """The per-device state: device -> its state, source id -> its rows,
    sources forgotten and not yet deleted from the table."""

    def __init__(self, db: Database, settings: BufferSettings, metrics: Metrics, catalog: Catalog) -> None:
        super().__init__(db, settings, metrics)
        self._catalog = catalog
        self.by_key: dict[str, Device] = {}
        self.src_rows: dict[int, int] = {}
        self.doomed: set[int] = set()
        self.idle_maybe = False

    # -- at submit (synchronous, ingest's hot path) -------------------------

    def admit(self, route: Route, mqtt_topic: str) -> Rejected | None:
        """May a record of `route` on `mqtt_topic` join the buffer?  None, or
        why not (a dead letter).  Call it right before `submit`."""
        d = self.by_key.get(route.key)
        s = self._settings
        if d is None:
            if len(self.by_key) >= s.max_devices and not self.forget_idle_devices():
                return Rejected(
                    DeadLetterReason.TOO_MANY_DEVICES,
                    f"the buffer already tracks buffer.max_devices = {s.max_devices} devices",
                )
            return None
        if mqtt_topic in d.topics or len(d.topics) < s.max_topics_per_device:
            return None
        if d.orphans and self._forget_orphans(d) and len(d.topics) < s.max_topics_per_device:
            return None
        return Rejected(
            DeadLetterReason.TOO_MANY_TOPICS,
            f"device {route.key[:64]!r} already has buffer.max_topics_per_device = "
            f"{s.max_topics_per_device} topics in the buffer",
        )

    def backlog_by_device(self) -> dict[str, tuple[int, int]]:
        """Committed records and their accounted bytes, per device holding any."""
        return {k: (d.records, d.bytes) for k, d in self.by_key.items() if d.records}

    def reserve(self, key: str, mqtt_topic: str) -> None:
        """A group holds records of this source (once per source and group:
        commit.py); `settle` takes it back after that group's commit."""
        d = self.by_key.get(key)
        if d is None:
            d = self.by_key[key] = Device()
        d.pending += 1
        d.topics[mqtt_topic] = d.topics.get(mqtt_topic, 0) + 1

    def settle(self, keys_topics: Iterable[tuple[str, str]]) -> None:
        """The commit of the group that reserved these (device, topic) is over (either way)."""
        devices = self.by_key
        for key, topic in keys_topics:
            d = devices[key]
            d.pending -= 1
            left = d.topics[topic] - 1
            if left:
                d.topics[topic] = left
            else:
                del d.topics[topic]
            if not d.pending and d.orphans == len(d.sids):
                self.idle_maybe = True
        self._metrics.devices_tracked.set(len(devices))

    # -- accounting (after a commit, per row) -------------------------------

    def register_source(self, sid: int, key: tuple[int, str, str]) -> None:
        self._catalog.add(sid, key)
        self.doomed.discard(sid)
        d = self.by_key.get(key[1])
        if d is None:
            d = self.by_key[key[1]] = Device()
        d.sids.add(sid)
        d.topics[key[2]] = d.topics.get(key[2], 0) + 1
        self.src_rows[sid] = 0
        d.orphans += 1

    def rows_added(self, rows: list[tuple[Any, ...]], sids: list[int]) -> None:
        """Rows (route_id, pkey, mqtt_topic, ..., payload) committed with these source ids."""
        src_rows = self.src_rows
        devices = self.by_key
        for r, sid in zip(rows, sids, strict=True):
            n = src_rows.get(sid)
            if n is None:  # forgotten while its commit was under way: it has a row now
                self.register_source(sid, (r[0], r[1], r[2]))
                n = 0
            d = devices[r[1]]
            if not n:
                d.orphans -= 1
            src_rows[sid] = n + 1
            d.records += 1
            d.bytes += len(r[6]) + len(r[2]) + ROW_OVERHEAD

    def row_gone(self, sid: int, size: int) -> None:
        """A row of `sid` with `size` accounted bytes was deleted."""
        n = self.src_rows.get(sid)
        if n is None:
            return
        d = self.by_key[self._catalog.source_names[sid][2]]
        d.records -= 1
        d.bytes -= size
        self.src_rows[sid] = n - 1
        if n == 1:
            d.orphans += 1
            if d.orphans == len(d.sids) and not d.pending:
                self.idle_maybe = True

    # -- forgetting ----------------------------------------------------------

    def _forget_orphans(self, d: Device) -> bool:
        """Forget the sources of `d` without rows (deleted from the table at
        the next commit).  True when any was forgotten."""
        gone = [sid for sid in d.sids if not self.src_rows[sid]]
        for sid in gone:
            _stream, _itopic, _key, topic = self._catalog.forget(sid)
            d.sids.discard(sid)
            del self.src_rows[sid]
            left = d.topics[topic] - 1
            if left:
                d.topics[topic] = left
            else:
                del d.topics[topic]
            self.doomed.add(sid)
        d.orphans = 0
        return bool(gone)

    def forget_idle_devices(self) -> bool:
        """Forget the devices with nothing in the buffer; True when any was.
        A scan of the devices, only when one may have become idle since the
        last scan (so a flood of new device levels costs O(1) a message)."""
        if not self.idle_maybe:
            return False
        self.idle_maybe = False
        idle = [k for k, d in self.by_key.items() if not d.pending and d.orphans == len(d.sids)]
        for k in idle:
            self._forget_orphans(self.by_key.pop(k))
        self._metrics.devices_tracked.set(len(self.by_key))
        return bool(idle)

    async def delete_doomed(self) -> None:
        """Inside a write transaction: delete the forgotten sources (a
        source that got a row meanwhile stays)."""
        if not self.doomed:
            return
        await self._conn.executemany(
            "DELETE FROM sources WHERE id = ? AND NOT EXISTS (SELECT 1 FROM outbox WHERE source_id = ?)",
            [(sid, sid) for sid in self.doomed],
        )

    async def load(self) -> None:
        """At open: delete orphaned sources, then account every device's rows."""
        await self._conn.execute(ORPHANS_SQL)
        rows = await self._db.fetchall("SELECT id, route_id, pkey, mqtt_topic FROM sources")
        for sid, rid, k, t in rows:
            self.register_source(int(sid), (int(rid), str(k), str(t)))
        counts = await self._db.fetchall(
            "SELECT source_id, count(*), sum(length(payload)) FROM outbox GROUP BY source_id"
        )
        for sid, n, nbytes in counts:
            names = self._catalog.source_names.get(int(sid))
            if names is None:
                continue
            d = self.by_key[names[2]]
            d.records += int(n)
            d.bytes += int(nbytes) + (len(names[3]) + ROW_OVERHEAD) * int(n)
            self.src_rows[int(sid)] = int(n)
            d.orphans -= 1
        self._metrics.devices_tracked.set(len(self.by_key))
