"""Forward: outbox -> Iggy, in batches, deleting only what Iggy confirmed.

One batch is in flight at a time and batches are read in outbox order, so
per partition key the records reach Iggy in ingest order, across outages and
restarts.  A batch is the oldest `batch_records` records (cut at
`batch_bytes`); when fewer are waiting, the forwarder lingers up to
`linger_ms` for more, so a trickle of telemetry still goes out in batches
without adding more than the linger to its latency.

Failures: `UplinkUnavailable` (nothing left the agent) and `UplinkRejected`
are retried with capped, full-jitter exponential backoff; the records stay
in the outbox meanwhile and ingest goes on.  `UplinkAmbiguous` (the request
may have been stored) is retried the same way and the records it covers are
counted in `iggy_edge_forward_ambiguous_retries_total`.  The other source of
duplicates: Iggy confirmed a batch but deleting it from the outbox failed
(disk error); the forwarder stage fails and is restarted, and the batch goes
out again -- counted in `iggy_edge_forward_resent_records_total`.  Both
carry the same message ids.

Recovery probe: the backoff grows to `backoff_max_s` (30 s), so after a long
outage the next attempt could come up to 30 s after the link returned.  When
the uplink can tell whether its server is reachable (`RecoveryProbe`, a bare
TCP connect to each known node for Iggy), a wait longer than a probe interval
is spent probing every 0.5-1 s (uniformly jittered, so a fleet that lost the
same cluster does not probe in step); once a probe that found nothing
reachable is followed by one that finds a node, the wait ends and the batch
is retried at once.  A failure while the node was reachable (a refused login,
a server still starting) is not cut short: the backoff protects it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Final, Protocol, runtime_checkable

from .backoff import backoff_delay
from .config import ForwardSettings
from .logs import RateLimitedLog
from .metrics import Metrics
from .records import OutboundRecord
from .stages import OutboxReader
from .timeouts import wait_for
from .uplink.protocol import Uplink, UplinkAmbiguous, UplinkError, UplinkRejected

log = logging.getLogger(__name__)

# Seconds between recovery probes while the uplink is down (uniform draw),
# and how long one probe waits for a TCP connect.
PROBE_INTERVAL_S: Final = (0.5, 1.0)
PROBE_TIMEOUT_S: Final = 0.5


@runtime_checkable
class RecoveryProbe(Protocol):
    """An uplink that can cheaply tell whether its server is reachable."""

    async def reachable(self, timeout: float) -> bool: ...


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
        self._failures = 0
        # Seqs Iggy has confirmed whose delete from the outbox has not yet
        # succeeded; kept across a restart of run() by the supervisor.
        self._undeleted: frozenset[int] = frozenset()
        self.up = asyncio.Event()
        self.down_since: float | None = None

    def stop(self) -> None:
        """Finish the batch in flight, then return from run()."""
        self._stopping.set()

    async def run(self) -> None:
        while not self._stopping.is_set():
            if not self._started and not await self._start_uplink():
                continue
            if not await self._outbox.wait_for_data(timeout=0.5):
                continue
            await self._linger()
            batch = await self._outbox.read_batch(self._settings.batch_records, self._settings.batch_bytes)
            if not batch:
                continue
            self._count_resent(batch)
            started = time.perf_counter()
            try:
                await self._uplink.send(batch)
            except UplinkError as e:
                if e.confirmed:
                    self._undeleted = e.confirmed
                    await self._account(await self._outbox.confirm(batch, e.confirmed), 0)
                    self._undeleted = frozenset()
                self._on_failure(e, len(batch) - len(e.confirmed))
                await self._backoff()
                continue
            self._metrics.forward_send_seconds.observe(time.perf_counter() - started)
            self._undeleted = frozenset(r.seq for r in batch)
            await self._account(await self._outbox.confirm(batch), 1)
            self._undeleted = frozenset()
            self._on_success()

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

    async def _linger(self) -> None:
        s = self._settings
        if self._outbox.records >= s.batch_records or not s.linger_ms:
            return
        deadline = time.monotonic() + s.linger_ms / 1000
        while self._outbox.records < s.batch_records and not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.005))

    async def _account(self, deleted: int, batches: int) -> None:
        self._metrics.forwarded.inc(deleted)
        self._metrics.forward_batches.inc(batches)

    def _on_success(self) -> None:
        if self._failures:
            log.info(
                "uplink is back after %d failed attempts (down %.1fs); draining %d records",
                self._failures,
                time.time() - (self.down_since or time.time()),
                self._outbox.records,
            )
        self._failures = 0
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
            self._failures - 1, self._settings.backoff_initial_s, self._settings.backoff_max_s
        )
        if isinstance(self._uplink, RecoveryProbe) and delay > PROBE_INTERVAL_S[1]:
            await self._probe_until(self._uplink, time.monotonic() + delay)
            return
        await self._wait(delay)

    async def _wait(self, seconds: float) -> bool:
        """Sleep `seconds` or until stop(); True when stopping."""
        with contextlib.suppress(TimeoutError):
            await wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    async def _probe_until(self, probe: RecoveryProbe, deadline: float) -> None:
        """Wait until `deadline`, or until the probe sees the link come back."""
        seen_down = False
        while True:
            left = deadline - time.monotonic()
            step = random.uniform(*PROBE_INTERVAL_S)  # noqa: S311 - jitter, not crypto
            if left <= 0 or await self._wait(min(left, step)) or time.monotonic() >= deadline:
                return
            if await probe.reachable(PROBE_TIMEOUT_S):
                if seen_down:
                    log.info("uplink: the probe reaches the server again; retrying now")
                    return
            else:
                seen_down = True
