"""Recovery probe: end a long backoff as soon as the server is reachable again.

A backoff grows to tens of seconds, so after a long outage the next attempt
could come that long after the link returned.  A stage whose remote end can
tell cheaply whether it is reachable (`RecoveryProbe`: a bare TCP connect to
each known Iggy node) spends a wait longer than a probe interval probing
every 0.5-1 s, uniformly jittered so a fleet that lost the same cluster does
not probe in step.  Once a probe that found nothing reachable is followed by
one that finds a node, the wait ends and the stage retries at once.  A
failure while the node was reachable (a refused login, a server still
starting) is not cut short: the backoff protects it.

The first probe goes out as the wait begins, right after the failure, so the
wait knows whether it began with the server down.  (When the first probe came
only after the first 0.5-1 s step, a link that returned within that step was
never seen down, and the stage waited out its whole backoff: 13.5 s after a
12 s cut in one run of tests/test_uplink_cluster.py.)

What the probes saw outlives one wait (`Link`, one per stage).  A wait is
cut short when a probe finds the server reachable and the last probe before
it, in this wait *or an earlier one*, found it down.  Judged by one wait
alone, a link that returned between the failed attempt and the first probe
of the next wait looked "reachable all along", and the stage sat out its
whole backoff, grown to tens of seconds by the outage (a 30 s cap).  The
stage forgets `Link.down` on its next success.

Used by the forwarder (uplink) and the return poll (command source), each of
which also starts its backoff afresh when a wait is cut short: the outage
that grew it is over, and a failure right after the link returned (a server
slow to answer the first login while a fleet reconnects, a request that
times out) is a new one, retried after the initial delay, not after the
outage's 30 s.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Final, Protocol, runtime_checkable

# Seconds between recovery probes while the remote end is down (uniform
# draw), and how long one probe waits for a TCP connect.
PROBE_INTERVAL_S: Final = (0.5, 1.0)
PROBE_TIMEOUT_S: Final = 0.5


@runtime_checkable
class RecoveryProbe(Protocol):
    """A remote end that can cheaply tell whether its server is reachable."""

    async def reachable(self, timeout: float) -> bool: ...


async def _sleep(seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return False


class Link:
    """What a stage's recovery probes have seen of its remote end, across
    backoff waits (module docstring)."""

    def __init__(self) -> None:
        # A probe found no node reachable, and none found one since (and the
        # stage has not succeeded since).
        self.down = False


async def backoff_wait(
    target: object,
    delay: float,
    wait: Callable[[float], Awaitable[bool]] = _sleep,
    link: Link | None = None,
) -> bool:
    """Wait `delay` seconds, probing when `target` is a RecoveryProbe and the
    delay is longer than a probe interval.  `wait(seconds)` sleeps and says
    whether the stage is stopping.  `link` carries what the probes saw from
    one wait to the next (a fresh one: this wait alone).  True when a probe
    found the server back (the wait was cut short), False otherwise."""
    if not isinstance(target, RecoveryProbe) or delay <= PROBE_INTERVAL_S[1]:
        await wait(delay)
        return False
    link = Link() if link is None else link
    deadline = time.monotonic() + delay
    while True:
        if await target.reachable(PROBE_TIMEOUT_S):
            if link.down:
                link.down = False
                return True
        else:
            link.down = True
        left = deadline - time.monotonic()
        step = random.uniform(*PROBE_INTERVAL_S)  # noqa: S311 - jitter, not crypto
        if left <= 0 or await wait(min(left, step)) or time.monotonic() >= deadline:
            return False
