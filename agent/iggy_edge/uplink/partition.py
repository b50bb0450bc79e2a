"""Which Iggy partition a partition key goes to, and what Iggy can carry.

Shared by every uplink (real Iggy, memory, file) so that tests, benchmarks and
production agree on where a key lands.

Partition function
------------------
``partition_for(key, count) = u32_be(blake2b(utf8(key), digest_size=4)) % count``

Partition ids are 0-based (Iggy 0.9 numbers partitions 0..count-1; a poll
without ``partition_id`` reads partition 0).

Why our own function instead of Iggy's ``Partitioning.messages_key``:

* ``messages_key`` applies one key to a whole send request.  We group a batch
  by partition, so one request carries many devices' records; with
  ``messages_key`` every key would need its own request.
* The function must be the same in the memory and file uplinks, which have no
  SDK, and it must not change when the SDK does (SDK 0.9 resolves the key in
  the client with its own murmur hash and a cached partition count -- an
  internal detail, not a contract).
* blake2b is in the standard library and, unlike ``hash()``, is not salted per
  process, so the same key maps to the same partition across restarts.

What is preserved: per key, order (a key always maps to one partition and a
partition is append-only) and placement across restarts.  What is not: changing
a topic's partition count remaps keys (``% count``), so per-key order across
such a change is not guaranteed; create topics with their final count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

from ..records import OutboundRecord

# Limits of an Iggy 0.9 message (iggy_common::IggyMessage / HeaderKey / HeaderValue).
MAX_PAYLOAD_BYTES: Final = 64 * 1000 * 1000
MAX_HEADERS_BYTES: Final = 100 * 1000  # encoded size of all user headers
MAX_HEADER_FIELD_BYTES: Final = 255  # a header key or string value: 1..=255 bytes


def partition_for(key: str, count: int) -> int:
    """Stable partition (0-based) of `key` in a topic with `count` partitions."""
    if count < 1:
        raise ValueError(f"partition count must be >= 1, got {count}")
    digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % count


def by_topic(batch: Sequence[OutboundRecord]) -> dict[tuple[str, str], list[OutboundRecord]]:
    """A batch grouped by (stream, topic), each group in batch order."""
    groups: dict[tuple[str, str], list[OutboundRecord]] = {}
    for r in batch:
        st = (r.stream, r.topic)
        group = groups.get(st)
        if group is None:
            groups[st] = group = []
        group.append(r)
    return groups


def record_problem(record: OutboundRecord) -> str | None:
    """Why Iggy would refuse this record, or None when it can be sent.

    Iggy rejects an empty payload, and header keys/values must be 1-255 bytes
    (an empty header value is left out on send, see `wire_headers`).  Routing
    should dead-letter such records before they reach the outbox; an uplink that
    meets one raises UplinkRejected, because no retry can send it.
    """
    if not record.payload:
        return "empty payload (Iggy requires at least one byte)"
    if len(record.payload) > MAX_PAYLOAD_BYTES:
        return f"payload of {len(record.payload)} bytes exceeds Iggy's {MAX_PAYLOAD_BYTES}"
    total = 0
    for name, value in record.headers.items():
        n, v = len(name.encode()), len(value.encode())
        if not 1 <= n <= MAX_HEADER_FIELD_BYTES:
            return f"header name {name[:40]!r} is {n} bytes (1-{MAX_HEADER_FIELD_BYTES})"
        if v > MAX_HEADER_FIELD_BYTES:
            return f"header {name!r} value is {v} bytes (max {MAX_HEADER_FIELD_BYTES})"
        total += n + v + 8
    if total > MAX_HEADERS_BYTES:
        return f"headers take about {total} bytes (max {MAX_HEADERS_BYTES})"
    return None


def wire_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers as sent to Iggy: string keys and values, empty values left out
    (Iggy has no empty header value; absent means empty)."""
    if all(headers.values()):
        return headers
    return {k: v for k, v in headers.items() if v}


class KeyPartitioner:
    """`partition_for` with a memo per (stream, topic, partition count), and
    the grouping every uplink does: records of one topic split by partition,
    order kept within each partition, partitions in order of first appearance.

    The memo is bounded (cleared when it grows past `max_keys`), so a flood of
    distinct keys costs hashing, not memory.
    """

    def __init__(self, max_keys: int = 100_000) -> None:
        self._memo: dict[tuple[str, str, int], dict[str, int]] = {}
        self._max_keys = max_keys

    async def lanes(
        self, batch: Sequence[OutboundRecord], partitions: Callable[[str, str], Awaitable[int]]
    ) -> list[tuple[tuple[str, str, int], list[OutboundRecord]]]:
        """`batch` split by (stream, topic, partition) in one pass, each part
        in batch order, parts in order of first appearance (what `by_topic`
        then `split` give, without the second pass: the drain's hot path).
        `partitions(stream, topic)` is the partition count of a topic."""
        lanes: dict[tuple[str, str, int], list[OutboundRecord]] = {}
        placed: dict[tuple[str, str, str], list[OutboundRecord]] = {}  # (stream, topic, key) -> its part
        for r in batch:
            k = (r.stream, r.topic, r.key)
            part = placed.get(k)
            if part is None:
                count = await partitions(r.stream, r.topic)
                memo = self._memo.get((r.stream, r.topic, count))
                if memo is None or len(memo) > self._max_keys:
                    memo = self._memo[(r.stream, r.topic, count)] = {}
                p = memo.get(r.key)
                if p is None:
                    p = memo[r.key] = partition_for(r.key, count)
                lane = (r.stream, r.topic, p)
                part = lanes.get(lane)
                if part is None:
                    part = lanes[lane] = []
                placed[k] = part
            part.append(r)
        return list(lanes.items())

    def split(
        self, stream: str, topic: str, count: int, records: Iterable[OutboundRecord]
    ) -> list[tuple[int, list[OutboundRecord]]]:
        memo = self._memo.get((stream, topic, count))
        if memo is None or len(memo) > self._max_keys:
            memo = self._memo[(stream, topic, count)] = {}
        groups: dict[int, list[OutboundRecord]] = {}
        for r in records:
            p = memo.get(r.key)
            if p is None:
                p = memo[r.key] = partition_for(r.key, count)
            group = groups.get(p)
            if group is None:
                groups[p] = group = []
            group.append(r)
        return list(groups.items())
