"""The return poll's offsets mirrored to the server: best effort, bounded,
and backing off when it fails.

SQLite holds the offsets (inbox.py); the server's copy only lets the cloud
side see how far a gateway has read.  So a mirror that fails is not tried
again every round but after a capped, jittered backoff (`backoff_delay`,
`BACKOFF_BASE_S` doubling to `BACKOFF_MAX_S`): in the fast cadence after a
command a round comes 20 times a second, and at 1,000 gateways on the 3-node
cluster the nodes refused the stores of many gateways for minutes ("rejecting
client request on non-primary partition replica"); retried every round, each
try held the gateway's one connection, and so its polls, for up to
`mirror_timeout_s`, and the fleet's retries took the nodes' CPU
(docs/scaling.md, run D).  A success resets the backoff.
"""

from __future__ import annotations

import time
from typing import Final

from ..backoff import backoff_delay
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..timeouts import wait_for
from ..uplink.protocol import CommandSource, UplinkError
from .inbox import Inbox
from .legacy import Partition

BACKOFF_BASE_S: Final = 1.0
BACKOFF_MAX_S: Final = 60.0


class OffsetMirror:
    def __init__(
        self, source: CommandSource, inbox: Inbox, metrics: Metrics, limited: RateLimitedLog
    ) -> None:
        self._source = source
        self._inbox = inbox
        self._metrics = metrics
        self._limited = limited
        self.mirrored: dict[Partition, int | None] = {}  # what the server has (as far as we know)
        self.failures = 0  # in a row
        self.next_at = 0.0  # monotonic: no try before

    async def mirror(self, last: dict[Partition, int], timeout_s: float) -> None:
        """Mirror every offset the server does not have yet, unless a failure's
        backoff is still running; the first failure ends the pass."""
        if time.monotonic() < self.next_at:
            return
        for part, offset in last.items():
            if offset < 0 or self.mirrored.get(part) == offset:
                continue
            try:
                await wait_for(
                    self._source.mirror_offset(part.stream, part.topic, part.partition_id, offset), timeout_s
                )
            except (UplinkError, TimeoutError) as e:
                self._metrics.downlink_errors.labels("mirror").inc()
                delay = backoff_delay(self.failures, BACKOFF_BASE_S, BACKOFF_MAX_S)
                self.failures += 1
                self.next_at = time.monotonic() + delay
                self._limited.warning(
                    "mirror",
                    "return poll: mirroring offset %d of %s failed (%s); retried in %.1fs",
                    offset,
                    part.source(offset),
                    e,
                    delay,
                )
                return
            self.failures = 0
            self.mirrored[part] = offset
            await self._inbox.set_mirrored(part.stream, part.topic, part.partition_id, offset)
