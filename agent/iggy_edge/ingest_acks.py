"""Ingest's work in flight: acknowledgements that wait for their group
commit, and the read gate that bounds that work (ingest.py).

`after(done, ack)` places a message's acknowledgement behind the commit it
belongs to; the acks of one group are written, on the connection that
delivered them, in one write once that commit has succeeded.  A failed
commit acknowledges nothing (the broker redelivers) and sets `store_broken`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

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

# (connection or None for QoS0, PUBACK/PUBREC, packet id, topic, payload)
Ack = tuple[hooks.Connection, int, int, "str | bytes", bytes]
ACK_CMD: Final = (0, codec.PUBACK, codec.PUBREC)


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
        self._ack_future: asyncio.Future[Any] | None = None
        self._ack_list: list[Ack] = []
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

    def after(self, done: asyncio.Future[Any], ack: Ack) -> None:
        """Acknowledge `ack` once `done` (its group commit) succeeded."""
        if not self.handlers:
            self.idle.clear()
        self.handlers += 1
        if done is self._ack_future and not done.done():
            self._ack_list.append(ack)
            return
        self._ack_future = done
        self._ack_list = acks = [ack]
        done.add_done_callback(partial(self._acknowledge, acks))

    def _acknowledge(self, acks: list[Ack], done: asyncio.Future[Any]) -> None:
        self._on_group()
        self.handlers -= len(acks)
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
        msgs: list[tuple[str, bytes]] = []
        if (self.observers or self.group_observers) and done not in self.dead_groups:
            msgs = [(t, p) for _, _, _, t, p in acks if isinstance(t, str)]
            for observe in self.observers:
                for topic, payload in msgs:
                    observe(topic, payload)
        conn: hooks.Connection = None
        out: list[bytes] = []
        ack = codec.ack
        for c, cmd, mid, _, _ in acks:
            if c is None:  # QoS0: nothing to acknowledge
                continue
            if c is not conn:
                hooks.write(conn, b"".join(out))
                conn, out = c, []
            out.append(ack(cmd, mid))
        hooks.write(conn, b"".join(out))
        if msgs:
            for observe_group in self.group_observers:
                observe_group(msgs)
