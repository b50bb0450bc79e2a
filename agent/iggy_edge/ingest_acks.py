"""Ingest's work in flight: acknowledgements that wait for their group
commit, and the read gate that bounds that work (ingest.py).

`after(done, conn, ack, msg)` places a message's acknowledgement (its
PUBACK/PUBREC packet, built on arrival) behind the commit it belongs to; the
acks of one group are written, on the connection that delivered them, in
one write once that commit has succeeded: per group one `b"".join`, no work
per message (a loop over the group's acks building each packet then was
about 4 % of ingest's CPU).  A failed
commit acknowledges nothing (the broker redelivers) and sets `store_broken`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final, cast

from . import gmqtt_hooks as hooks
from . import heap
from . import mqtt_codec as codec
from .metrics import Metrics
from .store import Outbox

# Stop reading the broker's socket while this many records wait for commit.
# Mosquitto 2.0.11 enforces our receive maximum only for its first burst to a
# resumed session; after the first acknowledgements it sends the rest of a
# queued backlog at once (seen with 50k queued: 48k in one group, 177 MB RSS).
# Not reading lets TCP flow control hold the backlog in the broker instead.
READ_PAUSE_AT: Final = 10_000
# ... and while this many payload bytes wait (bench/flood_bench.py: a 256 KiB
# flood's peak RSS follows this bound plus the payloads the cached SQLite
# statements keep bound, see store/commit.py `_insert_rows`).
READ_PAUSE_BYTES: Final = 4 * 1024 * 1024

ACK_CMD: Final = (0, codec.PUBACK, codec.PUBREC)
# A message as the observers get it: (topic, payload).  Bytes topics (not
# UTF-8) are only ever dead letters, whose groups the observers skip.
Msg = tuple["str | bytes", bytes]


class InFlight:
    def __init__(self, outbox: Outbox, metrics: Metrics, on_group: Callable[[], None]) -> None:
        self._outbox = outbox
        self._metrics = metrics
        self._on_group = on_group  # a group's commit is over (ingest adds up its counts)
        self.handlers = 0  # messages whose acknowledgement waits for a commit
        self.idle = asyncio.Event()
        self.idle.set()
        self.store_broken = asyncio.Event()
        # Called with (topic, payload) for every message once its record is
        # committed, before the acknowledgement; the return path watches
        # device acks here.  Observers must be quick and must not raise.
        self.observers: list[Callable[[str, bytes], None]] = []
        # Called (quick, must not raise) once per group commit, after its
        # acknowledgements, with its messages [(topic, payload)] in arrival
        # order (receipts: one call per group, not one per message).
        self.group_observers: list[Callable[[list[tuple[str, bytes]]], None]] = []
        # The commit futures of dead-letter groups (observers skip those).
        self.dead_groups: weakref.WeakSet[asyncio.Future[None]] = weakref.WeakSet()
        # The group whose acknowledgements are being gathered: its future,
        # the connection of its last ack, that connection's acks, and the
        # (connection, acks) segments and messages of the whole group.
        self._ack_future: asyncio.Future[Any] | None = None
        self._conn: hooks.Connection = None
        self._acks: list[bytes] = []
        self._segments: list[tuple[hooks.Connection, list[bytes]]] = []
        self._msgs: list[Msg] = []
        # Reads wait on _resume while READ_PAUSE_AT messages are in flight
        # (payload bytes in flight are the outbox's pending_bytes).
        self._resume = asyncio.Event()
        self._resume.set()
        self._trim_due = False  # a flood of bytes went through: trim the heap once it is over

    def read_gate(self) -> Awaitable[object] | None:
        """Before each socket read: wait while READ_PAUSE_AT messages or
        READ_PAUSE_BYTES payload bytes wait for their commit.

        Waiting inside gmqtt's `read` lets its buffer fill, the transport
        pause and TCP push back, so the backlog stays in the broker."""
        if self.handlers < READ_PAUSE_AT and self._outbox.pending_bytes < READ_PAUSE_BYTES:
            return None
        self._metrics.ingest_read_pauses.inc()
        return self._room()

    async def _room(self) -> None:
        if self._outbox.pending_bytes >= READ_PAUSE_BYTES:
            self._trim_due = True
        while self.handlers >= READ_PAUSE_AT:
            self._resume.clear()
            await self._resume.wait()
        await self._outbox.wait_pending_below(READ_PAUSE_AT, max_bytes=READ_PAUSE_BYTES)

    def after(self, done: asyncio.Future[Any], conn: hooks.Connection, ack: bytes, msg: Msg) -> None:
        """Acknowledge a message -- `ack`, its PUBACK/PUBREC packet (b"" for
        QoS0), on `conn` -- once `done` (its group commit) succeeded, and
        show `msg` to the observers then."""
        self.handlers += 1
        if done is not self._ack_future:
            self._open(done, conn)
        elif conn is not self._conn and ack:  # a new connection (QoS0 has no ack to place)
            self._conn = conn
            self._acks = []
            self._segments.append((conn, self._acks))
        self._acks.append(ack)
        self._msgs.append(msg)

    def _open(self, done: asyncio.Future[Any], conn: hooks.Connection) -> None:
        """The first message acknowledged after `done`: gather its group."""
        self.idle.clear()
        self._ack_future = done
        self._conn = conn
        self._acks = []
        self._segments = [(conn, self._acks)]
        self._msgs = []
        done.add_done_callback(partial(self._acknowledge, self._segments, self._msgs))

    def _acknowledge(
        self, segments: list[tuple[hooks.Connection, list[bytes]]], msgs: list[Msg], done: asyncio.Future[Any]
    ) -> None:
        if done is self._ack_future:
            self._ack_future = None  # later messages start a list of their own
        self._on_group()
        self.handlers -= len(msgs)
        if self.handlers == 0:
            self.idle.set()
            if self._trim_due:
                self._trim_due = False
                heap.trim()
        if self.handlers < READ_PAUSE_AT:
            self._resume.set()
        if done.cancelled() or done.exception() is not None:
            # Commit failed: acknowledge nothing, so the broker keeps the
            # messages and redelivers them on the next session.
            self.store_broken.set()
            return
        observed = bool(self.observers or self.group_observers) and done not in self.dead_groups
        committed = cast("list[tuple[str, bytes]]", msgs)  # str topics: see Msg
        if observed:
            for observe in self.observers:
                for topic, payload in committed:
                    observe(topic, payload)
        for conn, acks in segments:
            hooks.write(conn, b"".join(acks))
        if observed:
            for observe_group in self.group_observers:
                observe_group(committed)
