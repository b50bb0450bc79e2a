"""Sending to a real Iggy server: the uplink (outbox batches) and the
command sink (one message, the way the cloud side publishes commands).

Timestamps
    `SendMessage(...)` stamps the message's origin timestamp with the current
    time when it is constructed, and a batch stores each message as a u32
    microsecond delta from the batch's first origin timestamp (~71 minutes).
    We build the `SendMessage` objects immediately before the request, so a
    request spans milliseconds regardless of how old the records are.  The
    real event time travels in the ``received-at-us`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Final

from apache_iggy import SendMessage

from ...config import IggySettings
from ...records import OutboundRecord
from ..partition import KeyPartitioner, by_topic, record_problem, wire_headers
from ..protocol import Lane, UplinkError, UplinkRejected, UplinkUnavailable
from .connection import ClientFactory, Connection
from .errors import is_not_found
from .topics import Topics

LANE_IDLE_S: Final = 60.0  # a lane connection of its own unused this long is closed


def _to_send_message(record: OutboundRecord) -> SendMessage:
    return SendMessage(record.payload, wire_headers(record.headers), record.message_id)


class IggyUplink:
    """`Uplink` over a real Iggy server.

    `send` groups the batch by (stream, topic, partition) in order of first
    appearance, the partition being `partition_for(key, partition count)`
    (see partition.py), and sends each group as one request with an explicit
    partition id.  A group is all-or-nothing, and all records of one key are
    in one group, so a key is never split.  Groups are sent one after the
    other; the first failure stops the batch and is raised with `confirmed`
    holding the seqs of the groups sent before it.

    As a `LanedUplink` (what the forwarder uses) each (stream, topic,
    partition) is a lane, so requests to different partitions can run side
    by side: the server answers one request at a time per connection.  The
    first lane uses the uplink's own connection (`connection`, shared with
    the return path when the factory passes one); more lanes get
    connections of their own on their first send, at most
    ``settings.uplink_connections`` in all (lanes beyond share them, a lock
    keeping one request per connection).  A connection of its own that no
    send used for ``LANE_IDLE_S`` is closed (logged out): a gateway at rest
    holds one connection, a draining one up to ``uplink_connections``
    (issue 23: every connection is a login and a heartbeat for the server).
    Topic lookups and creation go over the uplink's own connection.
    """

    def __init__(
        self,
        settings: IggySettings,
        gateway_id: str,
        *,
        topics: Iterable[tuple[str, str]] = (),
        client_factory: ClientFactory | None = None,
        connection: Connection | None = None,
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self._conn = connection or Connection(settings, "uplink", client_factory)
        self._topics = Topics(self._conn)
        self._wanted = tuple(dict.fromkeys(topics))
        self._partitioner = KeyPartitioner()
        self._factory = client_factory
        self._lane_conns: dict[Lane, _LaneConnection] = {}
        self._pool: list[_LaneConnection] = [_LaneConnection(self._conn)]  # [0]: the uplink's own
        self._probe_from: Connection | None = None  # the lane connection that failed last
        self._reaper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect and log in (within connect_timeout_s) and make sure the
        configured topics exist (creating them if create_missing)."""
        await self._conn.client()
        for stream, topic in self._wanted:
            await self._topics.partitions(stream, topic)

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        if not batch:
            return
        confirmed: list[int] = []
        for (stream, topic), records in by_topic(batch).items():
            done = frozenset(confirmed)
            count = await self._topics.partitions(stream, topic, confirmed=done)
            for partition, group in self._partitioner.split(stream, topic, count, records):
                await self._send_group(self._conn, stream, topic, partition, group, frozenset(confirmed))
                confirmed.extend(r.seq for r in group)

    async def lanes(self, batch: Sequence[OutboundRecord]) -> list[tuple[Lane, list[OutboundRecord]]]:
        return await self._partitioner.lanes(batch, self._partitions)

    async def _partitions(self, stream: str, topic: str) -> int:
        return await self._topics.partitions(stream, topic)

    async def send_lane(self, lane: Lane, records: Sequence[OutboundRecord]) -> None:
        stream, topic, partition = lane
        lc = self._lane_connection(lane)
        async with lc.lock:
            try:
                await self._send_group(lc.conn, stream, topic, partition, list(records), frozenset())
            except UplinkError:
                # The recovery probe looks from where this connection goes
                # next (the node after the one that stopped answering), as
                # with one connection; see `reachable`.
                self._probe_from = lc.conn
                raise
            finally:
                lc.used = time.monotonic()

    def _lane_connection(self, lane: Lane) -> _LaneConnection:
        lc = self._lane_conns.get(lane)
        if lc is None:
            if len(self._pool) < self.settings.uplink_connections and self._lane_conns:
                role = f"uplink lane {len(self._pool) + 1}"
                lc = _LaneConnection(Connection(self.settings, role, self._factory))
                self._pool.append(lc)
                if self._reaper is None or self._reaper.done():
                    self._reaper = asyncio.create_task(self._reap(), name="iggy-uplink-lane-reaper")
            else:
                lc = self._pool[len(self._lane_conns) % len(self._pool)]
            self._lane_conns[lane] = lc
        return lc

    async def _reap(self) -> None:
        """Close the lane connections of their own no send used for
        LANE_IDLE_S (class docstring); ends when only the first is left."""
        while len(self._pool) > 1:
            await asyncio.sleep(LANE_IDLE_S / 2)
            now = time.monotonic()
            for lc in self._pool[1:]:
                if lc.lock.locked() or now - lc.used < LANE_IDLE_S:
                    continue
                self._pool.remove(lc)
                for lane in [k for k, v in self._lane_conns.items() if v is lc]:
                    del self._lane_conns[lane]
                if self._probe_from is lc.conn:
                    self._probe_from = None
                await lc.conn.close()

    async def _send_group(
        self,
        conn: Connection,
        stream: str,
        topic: str,
        partition: int,
        group: list[OutboundRecord],
        confirmed: frozenset[int],
    ) -> None:
        try:
            messages = [_to_send_message(r) for r in group]
        except ValueError as e:
            bad = [(r.seq, p) for r in group if (p := record_problem(r)) is not None]
            raise UplinkRejected(
                f"iggy: records Iggy cannot carry in {stream}/{topic}: {bad or e}",
                confirmed=confirmed,
            ) from e
        client = await conn.client()
        what = f"send {len(group)} to {stream}/{topic}/{partition}"
        try:
            await conn.call(
                what,
                client.send_messages(stream, topic, partition, messages),
                confirmed=confirmed,
            )
        except UplinkRejected as e:
            if is_not_found(e) and self.settings.create_missing:
                # The topic (or partition) went away under us: look it up
                # again, and create it, on the next attempt.
                self._topics.forget(stream, topic)
                raise UplinkUnavailable(str(e), confirmed=confirmed) from e
            raise

    async def reachable(self, timeout: float) -> bool:
        """Whether some node accepts a TCP connection now (the forwarder's
        recovery probe); the next connect starts at the first such node."""
        node = await (self._probe_from or self._conn).reachable(timeout)
        if node is not None:
            # Every lane starts its next connect there: a lane left on a node
            # that accepts connections but does not answer would otherwise
            # be sent back to it by each probe.
            for conn in (self._conn, *(lc.conn for lc in self._pool)):
                conn.prefer(node)
        return node is not None

    @property
    def node(self) -> str | None:
        """The node in use (None while not connected)."""
        return self._conn.node

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for lc in self._pool[1:]:
            await lc.conn.close()
        await self._conn.close()


class _LaneConnection:
    """A lane's connection, the lock that keeps one request on it, and when
    a send last used it (monotonic)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = asyncio.Lock()
        self.used = time.monotonic()


class IggyCommandSink:
    """Publishes messages the way the cloud side would (for `command send`
    and tests): one message, explicit partition, our headers as strings."""

    def __init__(self, settings: IggySettings, *, client_factory: ClientFactory | None = None) -> None:
        self.settings = settings
        self._conn = Connection(settings, "command sink", client_factory)
        self._topics = Topics(self._conn)

    async def start(self) -> None:
        await self._conn.client()

    async def publish(
        self,
        stream: str,
        topic: str,
        partition_id: int,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        message_id: int | None = None,
    ) -> int | None:
        """Send one message; returns its offset when the server reports it."""
        count = await self._topics.partitions(stream, topic)
        if not 0 <= partition_id < count:
            raise UplinkRejected(f"iggy: partition {partition_id} outside 0..{count - 1} of {stream}/{topic}")
        try:
            message = SendMessage(payload, wire_headers(headers or {}), message_id)
        except ValueError as e:
            raise UplinkRejected(f"iggy: message Iggy cannot carry: {e}") from e
        client = await self._conn.client()
        response = await self._conn.call(
            f"publish to {stream}/{topic}/{partition_id}",
            client.send_messages(stream, topic, partition_id, [message]),
        )
        for c in response.confirmations:
            if c.partition_id == partition_id:
                return c.base_offset
        return None

    async def close(self) -> None:
        await self._conn.close()


async def send_command(
    settings: IggySettings,
    stream: str,
    topic: str,
    partition_id: int,
    payload: bytes,
    headers: dict[str, str] | None = None,
    *,
    message_id: int | None = None,
) -> int | None:
    """One-shot publish for the CLI: connect, send one message, close."""
    sink = IggyCommandSink(settings)
    try:
        return await sink.publish(stream, topic, partition_id, payload, headers, message_id=message_id)
    finally:
        await sink.close()
