"""Forward: outbox -> Iggy, in batches, deleting only what Iggy confirmed.

Pipeline (issue 14).  A reader reads batches in outbox (seq) order, ahead of
the confirmations, and splits each by lane: one lane per Iggy partition
(`LanedUplink.lanes`; an uplink without lanes is one lane).  Each lane sends
its parts one request at a time, in order, queued parts merged into one
request up to the batch limits; lanes run side by side, each on its own
connection.  A key maps to one partition, so per key the records reach Iggy
in ingest order, across outages and restarts.  While the lanes send, the
reader already reads the next batches (at most ``batch_records x (lanes +
1)`` records and 4 x ``batch_bytes`` ahead of the deletes: memory stays
bounded).  Lanes confirm in any order; a delete loop deletes exactly the
confirmed seqs (`Outbox.confirm`), whatever the lanes confirmed since its
last delete in one statement.  A record leaves the outbox only after Iggy
confirmed it; a crash loses at most the deletes of the last confirmations,
so a restart re-sends only those (same ids) and what was never confirmed.

A batch is the oldest `batch_records` unread records (cut at
`batch_bytes`); when fewer are waiting, the reader lingers up to `linger_ms`
for more, so a trickle of telemetry still goes out in batches without adding
more than the linger to its latency.

On the first failure the pass ends: no lane starts another request, the
requests in flight finish, what they confirmed is deleted, and after the
backoff the next pass starts again from the oldest record in the outbox
(the failed lane's records first, so order holds).

Failures: `UplinkUnavailable` (nothing left the agent) and `UplinkRejected`
are retried with capped, full-jitter exponential backoff; the records stay
in the outbox meanwhile and ingest goes on.  `UplinkAmbiguous` (the request
may have been stored) is retried the same way and the records it covers are
counted in `iggy_edge_forward_ambiguous_retries_total`.  The other source of
duplicates: Iggy confirmed a batch but deleting it from the outbox failed
(disk error); the forwarder stage fails and is restarted, and those records go
out again -- counted in `iggy_edge_forward_resent_records_total`.  Both
carry the same message ids.

Recovery probe (`probe.py`): the backoff grows to `backoff_max_s` (30 s), so
after a long outage the next attempt could come up to 30 s after the link
returned; an uplink that can tell whether its server is reachable (a bare
TCP connect to each known Iggy node) is probed every 0.5-1 s meanwhile, and
the batch is retried as soon as the server is back -- also when it came back
between the failed attempt and the next wait's first probe (`Link`).  The
link's return ends the outage that grew the backoff: a failure right after
it is retried after ``backoff_initial_s``, not after the outage's delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from .backoff import backoff_delay
from .config import ForwardSettings
from .logs import RateLimitedLog
from .metrics import Metrics
from .probe import Link, backoff_wait
from .records import OutboundRecord
from .stages import OutboxReader
from .timeouts import wait_for
from .uplink.protocol import Lane, LanedUplink, Uplink, UplinkAmbiguous, UplinkError, UplinkRejected

log = logging.getLogger(__name__)

# Payload bytes read ahead of the confirmations, in batches (batch_bytes).
IN_FLIGHT_BATCHES_BYTES: Final = 4
# Seconds an idle forwarder waits for a commit before it reads the outbox
# anyway (`_wait_for_more`).
IDLE_RECHECK_S: Final = 30.0


@dataclass(eq=False)
class _Lane:
    """Parts of read batches waiting for one lane, oldest first, with their
    payload bytes; `task` sends them one request at a time."""

    parts: deque[tuple[list[OutboundRecord], int]] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class _Run:
    """One pass of the pipeline: from the oldest record in the outbox until
    stop() or the first failure.  See the module docstring."""

    def __init__(self) -> None:
        self.cursor = 0  # highest seq read so far
        self.in_flight = 0  # records read and not yet deleted
        self.in_flight_bytes = 0
        self.lanes: dict[Lane | None, _Lane] = {}
        self.lane_tasks: list[asyncio.Task[None]] = []
        self.confirmed: list[OutboundRecord] = []  # confirmed by Iggy, to delete
        self.confirmed_wake = asyncio.Event()
        self.lanes_done = False
        self.closing = False  # stop() or a failure: send no further request
        self.failure: tuple[UplinkError, int] | None = None
        self.changed = asyncio.Event()  # room freed, a failure, stop()

    def close(self) -> None:
        self.closing = True
        self.changed.set()
        for lane in self.lanes.values():
            lane.wake.set()


class Forwarder:
    def __init__(
        self, outbox: OutboxReader, uplink: Uplink, settings: ForwardSettings, metrics: Metrics
    ) -> None:
        self._outbox = outbox
        self._uplink = uplink
        self._settings = settings
        self._metrics = metrics
        self._limited = RateLimitedLog(log)
        self._stopping = asyncio.Event()
        self._started = False
        self._failures = 0  # since the last success (logged when the uplink is back)
        # Failures since the last success or since a probe found the server
        # back: the backoff's exponent (module docstring).
        self._retries = 0
        self._link = Link()  # what the recovery probes saw, across waits
        # Seqs Iggy has confirmed whose delete from the outbox has not yet
        # succeeded; kept across a restart of run() by the supervisor.
        self._undeleted: set[int] = set()
        self._run: _Run | None = None
        self.up = asyncio.Event()
        self.down_since: float | None = None

    def reconfigure(self, settings: ForwardSettings) -> None:
        """New batching and backoff (a reload, reload.py): from the next batch on."""
        self._settings = settings

    def stop(self) -> None:
        """Finish the requests in flight, then return from run()."""
        self._stopping.set()
        if self._run is not None:
            self._run.close()

    async def run(self) -> None:
        while not self._stopping.is_set():
            if not self._started and not await self._start_uplink():
                continue
            failure = await self._pass()
            if failure is not None:
                self._on_failure(*failure)
                await self._backoff()

    async def _pass(self) -> tuple[UplinkError, int] | None:
        """Run the pipeline until stop() or a failure (returned, with the
        records it left unconfirmed); the lanes finish the request they have
        in flight and what Iggy confirmed is deleted before this returns.
        Store errors raise (the supervisor restarts the stage)."""
        run = self._run = _Run()
        deleter = asyncio.create_task(self._delete_loop(run), name="forward-delete")
        try:
            try:
                await self._read_loop(run)
            finally:
                run.close()
            # stop() or a failure: the requests in flight finish (each is
            # bounded by the uplink), then what they confirmed is deleted.
            await asyncio.gather(*run.lane_tasks)
            run.lanes_done = True
            run.confirmed_wake.set()
            await deleter
        except BaseException:
            # Cancelled (the shutdown's bound ran out) or a store error:
            # nothing more is sent or deleted; the rest stays in the outbox.
            for t in (*run.lane_tasks, deleter):
                t.cancel()
            await asyncio.gather(*run.lane_tasks, deleter, return_exceptions=True)
            self._undeleted.update([r.seq for r in run.confirmed])  # confirmed, never deleted
            raise
        finally:
            self._run = None
        return run.failure

    async def _read_loop(self, run: _Run) -> None:
        """Read batches ahead of the lanes, split them by lane, queue them."""
        s = self._settings
        laned = self._uplink if isinstance(self._uplink, LanedUplink) else None
        while not run.closing and not self._stopping.is_set():
            cap = s.batch_records * (len(run.lanes) + 1)
            if run.in_flight >= cap or run.in_flight_bytes >= IN_FLIGHT_BATCHES_BYTES * s.batch_bytes:
                run.changed.clear()
                await run.changed.wait()
                continue
            if self._outbox.records > run.in_flight and not self._unread_fill_a_batch(run):
                await self._linger(run)
            batch = await self._outbox.read_batch(s.batch_records, s.batch_bytes, after=run.cursor)
            if not batch:
                await self._wait_for_more(run)
                continue
            run.cursor = batch[-1].seq
            self._count_resent(batch)
            try:
                parts: list[tuple[Lane | None, list[OutboundRecord]]] = (
                    [(None, list(batch))] if laned is None else list(await laned.lanes(batch))
                )
            except UplinkError as e:
                run.failure = run.failure or (e, len(batch))
                return
            run.in_flight += len(batch)
            for key, records in parts:
                nbytes = sum([len(r.payload) for r in records])
                run.in_flight_bytes += nbytes
                lane = run.lanes.get(key)
                if lane is None:
                    lane = run.lanes[key] = _Lane()
                    run.lane_tasks.append(
                        asyncio.create_task(self._lane_loop(run, key, lane), name=f"forward-lane-{key}")
                    )
                lane.parts.append((records, nbytes))
                lane.wake.set()

    async def _wait_for_more(self, run: _Run) -> None:
        """Until a commit adds records, a stop or a failure.  Every commit
        that adds records sets the outbox's event (`Outbox.wait_for_more`),
        and nothing else adds any while the agent runs (the CLI's replay
        needs the file to itself), so the wait is on that event alone; the
        re-read after `IDLE_RECHECK_S` is a safety net, not a cadence.  (It
        was 0.5 s: an idle gateway read its outbox twice a second for
        nothing, bench/idle_bench.py, and hid a lost wake-up: a failure
        during the empty read before this wait had set `changed` already.)"""
        run.changed.clear()
        if run.closing:  # closed while the read ran: its set() is the one just cleared
            return
        more = asyncio.ensure_future(self._outbox.wait_for_more(IDLE_RECHECK_S))
        changed = asyncio.ensure_future(run.changed.wait())
        try:
            await asyncio.wait((more, changed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (more, changed):
                t.cancel()
            await asyncio.gather(more, changed, return_exceptions=True)

    async def _lane_loop(self, run: _Run, key: Lane | None, lane: _Lane) -> None:
        """One request in flight for this lane, its parts in outbox order;
        queued parts are merged into one request up to the batch limits."""
        s = self._settings
        while not run.closing:
            if not lane.parts:
                lane.wake.clear()
                await lane.wake.wait()
                continue
            records, nbytes = lane.parts.popleft()
            while lane.parts:
                more, more_bytes = lane.parts[0]
                if len(records) + len(more) > s.batch_records or nbytes + more_bytes > s.batch_bytes:
                    break
                lane.parts.popleft()
                records = records + more
                nbytes += more_bytes
            started = time.perf_counter()
            try:
                if key is None or not isinstance(self._uplink, LanedUplink):
                    await self._uplink.send(records)
                else:
                    await self._uplink.send_lane(key, records)
            except UplinkError as e:
                if e.confirmed:
                    self._confirmed(run, [r for r in records if r.seq in e.confirmed])
                if run.failure is None:
                    run.failure = (e, len(records) - len(e.confirmed))
                run.close()
                return
            self._metrics.forward_send_seconds.observe(time.perf_counter() - started)
            self._metrics.forward_batches.inc()
            self._on_success()
            self._confirmed(run, records)

    def _confirmed(self, run: _Run, records: list[OutboundRecord]) -> None:
        """Iggy confirmed `records`: hand them to the delete loop (what it
        could not delete goes to `_undeleted` when it fails)."""
        run.confirmed.extend(records)
        run.confirmed_wake.set()

    async def _delete_loop(self, run: _Run) -> None:
        """Delete what Iggy confirmed, whatever the lanes confirmed since the
        last delete in one go (lanes confirm in any order: the outbox deletes
        exactly the seqs given).  A store error raises out of run()."""
        while True:
            if not run.confirmed:
                if run.lanes_done:
                    return
                run.confirmed_wake.clear()
                await run.confirmed_wake.wait()
                continue
            records, run.confirmed = run.confirmed, []
            try:
                deleted = await self._outbox.confirm(records)
            except BaseException:
                self._undeleted.update([r.seq for r in records])
                run.close()
                raise
            if self._undeleted:  # re-sent after a failed delete: now gone
                self._undeleted.difference_update([r.seq for r in records])
            self._metrics.forwarded.inc(deleted)
            run.in_flight -= len(records)
            run.in_flight_bytes -= sum([len(r.payload) for r in records])
            run.changed.set()

    def _count_resent(self, batch: list[OutboundRecord]) -> None:
        """Records Iggy already has (their delete failed) that go out again."""
        if not self._undeleted:
            return
        again = sum(1 for r in batch if r.seq in self._undeleted)
        if again:
            self._metrics.forward_resent.inc(again)
            self._limited.warning(
                "resent",
                "re-sending %d records Iggy already confirmed (deleting them from the outbox failed);"
                " same message ids",
                again,
            )

    async def _start_uplink(self) -> bool:
        try:
            await self._uplink.start()
        except UplinkError as e:
            self._on_failure(e, 0)
            await self._backoff()
            return False
        self._started = True
        log.info("uplink started")
        return True

    def _unread_fill_a_batch(self, run: _Run) -> bool:
        """Enough unread for a full batch, by records or by bytes.  (Bytes:
        with 200 kB payloads a batch is five records; waiting for a thousand
        lingered before every read and held a drain to 20 MB/s.  The outbox
        counts topic and row overhead too, so this errs towards not waiting.)"""
        s = self._settings
        return (
            self._outbox.records - run.in_flight >= s.batch_records
            or self._outbox.bytes - run.in_flight_bytes >= s.batch_bytes
        )

    async def _linger(self, run: _Run) -> None:
        """Wait up to linger_ms for a full batch of unread records."""
        s = self._settings
        if not s.linger_ms:
            return
        deadline = time.monotonic() + s.linger_ms / 1000
        while not self._unread_fill_a_batch(run) and not run.closing:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.005))

    def _on_success(self) -> None:
        if self._failures:
            log.info(
                "uplink is back after %d failed attempts (down %.1fs); draining %d records",
                self._failures,
                time.time() - (self.down_since or time.time()),
                self._outbox.records,
            )
        self._failures = 0
        self._retries = 0
        self._link.down = False
        self.down_since = None
        self._metrics.uplink_up.set(1)
        self._metrics.uplink_down_since.set(0)
        self.up.set()

    def _on_failure(self, e: UplinkError, unconfirmed: int) -> None:
        kind = (
            "ambiguous"
            if isinstance(e, UplinkAmbiguous)
            else "rejected"
            if isinstance(e, UplinkRejected)
            else "unavailable"
        )
        if isinstance(e, UplinkAmbiguous):
            self._metrics.forward_ambiguous_retries.inc(unconfirmed)
        self._metrics.forward_errors.labels(kind).inc()
        self._failures += 1
        self._retries += 1
        if self.down_since is None:
            self.down_since = time.time()
            self._metrics.uplink_down_since.set(self.down_since)
        self._metrics.uplink_up.set(0)
        self.up.clear()
        self._limited.warning(
            f"uplink-{kind}",
            "uplink %s: %s; %d records buffered, retrying with backoff",
            kind,
            e,
            self._outbox.records,
        )

    async def _backoff(self) -> None:
        delay = backoff_delay(
            self._retries - 1, self._settings.backoff_initial_s, self._settings.backoff_max_s
        )
        if await backoff_wait(self._uplink, delay, self._wait, self._link):
            self._retries = 0
            log.info("uplink: the probe reaches the server again; retrying now")

    async def _wait(self, seconds: float) -> bool:
        """Sleep `seconds` or until stop(); True when stopping."""
        with contextlib.suppress(TimeoutError):
            await wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()
