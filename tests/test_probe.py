"""The recovery probe's wait (probe.py): cut short when the server comes
back, never for a failure while it was reachable.  The remote end is a
stand-in here (the `RecoveryProbe` boundary is ours); the real one, a TCP
connect through a proxy that cuts the link, is in tests/test_uplink_cluster.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from iggy_edge import probe
from iggy_edge.probe import Link, backoff_wait

# wall-clock bounds: one after another on one xdist worker
pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("timing")]


class Remote:
    """Unreachable until `up_at` (monotonic), reachable from then on; counts probes."""

    def __init__(self, up_at: float) -> None:
        self.up_at = up_at
        self.probes = 0

    async def reachable(self, timeout: float) -> bool:
        self.probes += 1
        return time.monotonic() >= self.up_at


@pytest.fixture(autouse=True)
def _fast_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "PROBE_INTERVAL_S", (0.1, 0.2))


async def test_a_link_back_before_the_first_step_still_ends_the_wait() -> None:
    """The failure happened with the server down, and it was back before the
    first jittered probe: the wait must still end then, not run its course
    (it did, when the first probe came only after the first step)."""
    started = time.monotonic()
    remote = Remote(up_at=started + 0.03)
    assert await backoff_wait(remote, 5.0) is True
    assert time.monotonic() - started < 1.0


async def test_a_link_back_later_ends_the_wait_within_a_probe_interval() -> None:
    started = time.monotonic()
    remote = Remote(up_at=started + 0.6)
    assert await backoff_wait(remote, 5.0) is True
    assert 0.6 <= time.monotonic() - started < 1.2


async def test_a_link_back_before_the_next_wait_begins_ends_that_wait() -> None:
    """An earlier wait's probes saw the server down; the stage's attempt then
    failed (still down) and the link returned before the next wait's first
    probe.  That wait must end at once, not run its course as if the server
    had been reachable all along (it did: a 16 s backoff after a 12 s cut)."""
    link = Link()
    remote = Remote(up_at=float("inf"))
    assert await backoff_wait(remote, 0.3, link=link) is False  # ran its course: down all along
    assert link.down
    remote.up_at = 0.0  # back between the failed attempt and the next wait
    started = time.monotonic()
    assert await backoff_wait(remote, 5.0, link=link) is True
    assert time.monotonic() - started < 0.5
    assert not link.down
    # Back and then failing (a refused login): the next wait runs its course.
    started = time.monotonic()
    assert await backoff_wait(remote, 0.5, link=link) is False
    assert time.monotonic() - started >= 0.5


async def test_a_failure_while_reachable_waits_out_the_backoff() -> None:
    """A refused login or a server still starting: reachable all along, so the
    backoff protects the server and the wait is not cut short."""
    started = time.monotonic()
    remote = Remote(up_at=0.0)
    assert await backoff_wait(remote, 0.8) is False
    assert time.monotonic() - started >= 0.8
    assert remote.probes >= 2  # it kept probing, found no change


async def test_a_stage_that_cannot_probe_sleeps_and_a_stop_ends_any_wait() -> None:
    started = time.monotonic()
    assert await backoff_wait(object(), 0.3) is False
    assert time.monotonic() - started >= 0.3

    async def stopping(seconds: float) -> bool:
        await asyncio.sleep(0)
        return True

    started = time.monotonic()
    assert await backoff_wait(Remote(up_at=float("inf")), 30.0, stopping) is False
    assert time.monotonic() - started < 0.5
