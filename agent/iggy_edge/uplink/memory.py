"""An in-process stand-in for a tiny Iggy, for tests, benchmarks and the demo.

`MemoryIggy` holds streams/topics/partitions as lists (offset = index),
message ids, headers, payloads and consumer offsets.  It offers both sides of
the boundary:

* `MemoryIggy.uplink()` -> `MemoryUplink` (an `Uplink`)
* `MemoryIggy.command_source(consumer)` -> `MemoryCommandSource` (a `CommandSource`)
* `MemoryIggy.publish(...)` -- what the cloud side would send to a gateway

It partitions with the same `partition_for` as the real uplink.  Each
(stream, topic, partition) group of a batch is one "request", all or nothing,
like a real send.

Fault injection
    ``down = True``            every call raises UplinkUnavailable
    ``fail_next(n, after=k)``  after k more requests succeed, the next n fail
                               with UplinkUnavailable (nothing stored), or with
                               ``ambiguous=True`` are stored *and then* raise
                               UplinkAmbiguous -- a real duplicate on retry
    ``latency_s``              each send/poll awaits this long first

Speed: `send` does O(n) list appends of references (no copying, no per-record
encoding); with ``keep_payloads=False`` it keeps only message ids and keys,
which is what the drain benchmark needs for a million records.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..records import OutboundRecord
from .partition import KeyPartitioner, by_topic, record_problem
from .protocol import Lane, PolledMessage, UplinkAmbiguous, UplinkRejected, UplinkUnavailable


@dataclass(slots=True)
class MemoryPartition:
    """One partition.  Offsets are list indexes; `records` is filled only when
    the store keeps payloads (published messages are always kept)."""

    ids: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    timestamps_us: list[int] = field(default_factory=list)
    records: list[OutboundRecord | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(slots=True)
class _Fault:
    after: int
    count: int
    ambiguous: bool


class MemoryIggy:
    def __init__(
        self,
        *,
        partitions: int = 3,
        keep_payloads: bool = True,
        create_missing: bool = True,
        latency_s: float = 0.0,
        validate: bool = False,
    ) -> None:
        """`validate` checks every record against Iggy's limits (as the real
        server would refuse them); off by default because it costs per-record
        work the benchmark does not want."""
        self.partitions = partitions
        self.keep_payloads = keep_payloads
        self.create_missing = create_missing
        self.latency_s = latency_s
        self.validate = validate
        self.down = False
        self.topics: dict[tuple[str, str], list[MemoryPartition]] = {}
        self.consumer_offsets: dict[tuple[str, str, str, int], int] = {}
        self.requests = 0  # successful send requests (groups)
        self.failed_requests = 0
        self._faults: list[_Fault] = []
        self._partitioner = KeyPartitioner()

    # -- administration and inspection (tests) ---------------------------------

    def create_topic(self, stream: str, topic: str, partitions: int | None = None) -> None:
        if (stream, topic) not in self.topics:
            n = partitions or self.partitions
            self.topics[(stream, topic)] = [MemoryPartition() for _ in range(n)]

    def _topic(self, stream: str, topic: str) -> list[MemoryPartition]:
        parts = self.topics.get((stream, topic))
        if parts is None:
            if not self.create_missing:
                raise UplinkRejected(f"memory iggy: topic {stream}/{topic} was not found")
            self.create_topic(stream, topic)
            parts = self.topics[(stream, topic)]
        return parts

    def partition(self, stream: str, topic: str, partition_id: int) -> MemoryPartition:
        return self.topics[(stream, topic)][partition_id]

    def count(self, stream: str | None = None, topic: str | None = None) -> int:
        return sum(
            len(p)
            for (s, t), parts in self.topics.items()
            if (stream is None or s == stream) and (topic is None or t == topic)
            for p in parts
        )

    def ids(self, stream: str, topic: str, partition_id: int | None = None) -> list[int]:
        """Stored message ids of one partition, or of all partitions in
        partition order."""
        parts = self.topics.get((stream, topic), [])
        if partition_id is not None:
            return list(parts[partition_id].ids)
        return [i for p in parts for i in p.ids]

    def ids_by_key(self, stream: str, topic: str) -> dict[str, list[int]]:
        """Message ids per partition key, in stored order."""
        out: dict[str, list[int]] = {}
        for p in self.topics.get((stream, topic), []):
            for key, mid in zip(p.keys, p.ids, strict=True):
                out.setdefault(key, []).append(mid)
        return out

    def messages(self, stream: str, topic: str, partition_id: int) -> list[PolledMessage]:
        part = self.partition(stream, topic, partition_id)
        return self._read(part, 0, len(part))

    def fail_next(self, n: int = 1, *, ambiguous: bool = False, after: int = 0) -> None:
        """The next `n` requests (after `after` more succeed) fail.  A request
        is one (stream, topic, partition) group of a send, or one poll."""
        self._faults.append(_Fault(after=after, count=n, ambiguous=ambiguous))

    def publish(
        self,
        stream: str,
        topic: str,
        partition_id: int,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        message_id: int = 0,
        key: str = "",
    ) -> int:
        """Append one message as the cloud side would; returns its offset."""
        part = self._topic(stream, topic)[partition_id]
        offset = len(part)
        rec = OutboundRecord(
            seq=0,
            message_id=message_id,
            stream=stream,
            topic=topic,
            key=key,
            payload=payload,
            headers=dict(headers or {}),
        )
        part.ids.append(message_id)
        part.keys.append(key)
        part.timestamps_us.append(time.time_ns() // 1000)
        part.records.append(rec)
        return offset

    def stored_offset(self, consumer: str, stream: str, topic: str, partition_id: int) -> int | None:
        return self.consumer_offsets.get((consumer, stream, topic, partition_id))

    def uplink(self) -> MemoryUplink:
        return MemoryUplink(self)

    def command_source(self, consumer_name: str = "iggy-edge") -> MemoryCommandSource:
        return MemoryCommandSource(self, consumer_name)

    # -- internals -------------------------------------------------------------

    def _check_down(self, what: str, confirmed: frozenset[int] = frozenset()) -> None:
        if self.down:
            raise UplinkUnavailable(f"memory iggy is down ({what})", confirmed=confirmed)

    def _take_fault(self) -> _Fault | None:
        """Consume one request's worth of the fault plan; the fault that hits
        this request, if any."""
        if not self._faults:
            return None
        f = self._faults[0]
        if f.after > 0:
            f.after -= 1
            return None
        f.count -= 1
        if f.count <= 0:
            self._faults.pop(0)
        return f

    def _append(self, part: MemoryPartition, group: list[OutboundRecord]) -> None:
        part.ids.extend([r.message_id for r in group])
        part.keys.extend([r.key for r in group])
        part.timestamps_us.extend([time.time_ns() // 1000] * len(group))
        if self.keep_payloads:
            part.records.extend(group)
        else:
            part.records.extend([None] * len(group))

    def _read(self, part: MemoryPartition, offset: int, count: int) -> list[PolledMessage]:
        end = min(len(part), offset + count)
        out: list[PolledMessage] = []
        for i in range(offset, end):
            rec = part.records[i]
            out.append(
                PolledMessage(
                    offset=i,
                    message_id=part.ids[i],
                    payload=rec.payload if rec is not None else b"",
                    headers=dict(rec.headers) if rec is not None else {},
                    timestamp_us=part.timestamps_us[i],
                )
            )
        return out


class MemoryUplink:
    """`Uplink` view of a MemoryIggy."""

    def __init__(self, iggy: MemoryIggy) -> None:
        self.iggy = iggy
        self.closed = False

    async def start(self) -> None:
        self.iggy._check_down("start")

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        iggy = self.iggy
        if iggy.latency_s:
            await asyncio.sleep(iggy.latency_s)
        iggy._check_down("send")
        if not batch:
            return
        confirmed: list[int] = []
        for (stream, topic), records in by_topic(batch).items():
            try:
                parts = iggy._topic(stream, topic)
            except UplinkRejected as e:
                raise UplinkRejected(str(e), confirmed=frozenset(confirmed)) from None
            for p, group in iggy._partitioner.split(stream, topic, len(parts), records):
                self._store(stream, topic, parts, p, group, frozenset(confirmed))
                confirmed.extend([r.seq for r in group])

    def _store(
        self,
        stream: str,
        topic: str,
        parts: list[MemoryPartition],
        p: int,
        group: list[OutboundRecord],
        confirmed: frozenset[int],
    ) -> None:
        """One partition's request: validation, injected faults, the append.
        `confirmed`: what earlier requests of the same send already stored."""
        iggy = self.iggy
        if iggy.validate:
            bad = [(r.seq, x) for r in group if (x := record_problem(r)) is not None]
            if bad:
                raise UplinkRejected(f"memory iggy: records Iggy cannot carry: {bad}", confirmed=confirmed)
        fault = iggy._take_fault()
        if fault is not None:
            iggy.failed_requests += 1
            what = f"injected failure on {stream}/{topic}/{p}"
            if fault.ambiguous:
                iggy._append(parts[p], group)
                raise UplinkAmbiguous(what + " (stored)", confirmed=confirmed)
            raise UplinkUnavailable(what, confirmed=confirmed)
        iggy._append(parts[p], group)
        iggy.requests += 1

    async def lanes(self, batch: Sequence[OutboundRecord]) -> list[tuple[Lane, list[OutboundRecord]]]:
        """`LanedUplink.lanes`: one lane per (stream, topic, partition)."""
        iggy = self.iggy
        iggy._check_down("send")
        return await iggy._partitioner.lanes(batch, self._partitions)

    async def _partitions(self, stream: str, topic: str) -> int:
        return len(self.iggy._topic(stream, topic))

    async def send_lane(self, lane: Lane, records: Sequence[OutboundRecord]) -> None:
        """`LanedUplink.send_lane`: one request (faults and latency apply)."""
        iggy = self.iggy
        if iggy.latency_s:
            await asyncio.sleep(iggy.latency_s)
        iggy._check_down("send")
        stream, topic, p = lane
        self._store(stream, topic, iggy._topic(stream, topic), p, list(records), frozenset())

    async def close(self) -> None:
        self.closed = True


class MemoryCommandSource:
    """`CommandSource` view of a MemoryIggy; offsets are mirrored under
    `consumer_name`."""

    def __init__(self, iggy: MemoryIggy, consumer_name: str) -> None:
        self.iggy = iggy
        self.consumer_name = consumer_name
        self.polls = 0  # requests, for the return path's load (bench/command_latency_bench.py)
        self.probes = 0

    async def start(self) -> None:
        self.iggy._check_down("start")

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        iggy = self.iggy
        if iggy.latency_s:
            await asyncio.sleep(iggy.latency_s)
        iggy._check_down("poll")
        self.polls += 1
        fault = iggy._take_fault()
        if fault is not None:
            iggy.failed_requests += 1
            kind = UplinkAmbiguous if fault.ambiguous else UplinkUnavailable
            raise kind(f"injected failure polling {stream}/{topic}/{partition_id}")
        parts = iggy._topic(stream, topic)
        if not 0 <= partition_id < len(parts):
            raise UplinkRejected(f"memory iggy: partition {partition_id} of {stream}/{topic} was not found")
        return iggy._read(parts[partition_id], offset, count)

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        iggy = self.iggy
        if iggy.latency_s:
            await asyncio.sleep(iggy.latency_s)
        iggy._check_down("last offsets")
        self.probes += 1
        parts = iggy.topics.get((stream, topic))
        return None if parts is None else {i: len(p) - 1 for i, p in enumerate(parts)}

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        self.iggy._check_down("mirror offset")
        self.iggy.consumer_offsets[(self.consumer_name, stream, topic, partition_id)] = offset

    async def close(self) -> None:
        pass


_shared: MemoryIggy | None = None


def shared_memory_iggy() -> MemoryIggy:
    """The process-wide MemoryIggy used when settings say ``kind = "memory"``
    (so the uplink and the command source of one agent see the same store).
    Created on first use; tests replace or reset it with `set_shared_memory_iggy`."""
    global _shared  # noqa: PLW0603 -- one deliberate process-wide instance
    if _shared is None:
        _shared = MemoryIggy()
    return _shared


def set_shared_memory_iggy(iggy: MemoryIggy | None) -> None:
    global _shared  # noqa: PLW0603 -- see shared_memory_iggy
    _shared = iggy
