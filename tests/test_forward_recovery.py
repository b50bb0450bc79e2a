"""The forwarder coming back after an outage (forward.py, probe.py): a link
that returns between a failed attempt and the next wait's first probe must
end that wait at once.  The server is a MemoryIggy behind a stand-in for the
recovery probe (the `RecoveryProbe` boundary is ours); the real link, through
a TCP proxy that cuts it, is in tests/test_uplink_cluster.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from iggy_edge import probe
from iggy_edge.config import BufferSettings, ForwardSettings
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import OutboundRecord, Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.memory import MemoryIggy, MemoryUplink
from iggy_edge.uplink.protocol import Lane, UplinkUnavailable

from tests.support.wait import async_wait_until

# wall-clock bounds: one after another on one xdist worker
pytestmark = [pytest.mark.unit, pytest.mark.xdist_group("timing")]


class ProbedUplink(MemoryUplink):
    """A MemoryUplink whose server a probe reaches unless it is down; once
    `heal_on_failure` is set, the server comes back the moment an attempt
    fails (`healed_at`, monotonic): before the forwarder's next wait begins."""

    def __init__(self, iggy: MemoryIggy) -> None:
        super().__init__(iggy)
        self.heal_on_failure = False
        self.healed_at: float | None = None

    async def reachable(self, timeout: float) -> bool:
        return not self.iggy.down

    async def start(self) -> None:
        try:
            await super().start()
        except UplinkUnavailable:
            self._failed()
            raise

    async def lanes(self, batch: Sequence[OutboundRecord]) -> list[tuple[Lane, list[OutboundRecord]]]:
        try:
            return await super().lanes(batch)
        except UplinkUnavailable:
            self._failed()
            raise

    async def send_lane(self, lane: Lane, records: Sequence[OutboundRecord]) -> None:
        try:
            await super().send_lane(lane, records)
        except UplinkUnavailable:
            self._failed()
            raise

    def _failed(self) -> None:
        if self.heal_on_failure and self.healed_at is None:
            self.iggy.down = False
            self.healed_at = time.monotonic()


def _errors(metrics: Metrics) -> float:
    return metrics.value("iggy_edge_forward_errors_total", kind="unavailable")


async def test_a_link_back_before_the_next_wait_begins_resumes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six failed attempts while the server is down (the probes of the longer
    waits find it down), then it comes back right as the seventh fails: the
    wait after it is 0-9.6 s.  Judged by that wait's first probe alone the
    server looked reachable all along, and the old forwarder sat out the
    whole wait (it passed this about 1 run in 10)."""
    monkeypatch.setattr(probe, "PROBE_INTERVAL_S", (0.1, 0.2))
    metrics = Metrics()
    box = await Outbox.open(tmp_path / "buffer.db", BufferSettings(commit_interval_ms=0), "gw-heal", metrics)
    box.start()
    for i in range(5):
        await box.submit(
            Incoming(Route("edge", "telemetry", "dev"), "edge/dev/up/env", 1, False, i + 1, b"x")
        )
    iggy = MemoryIggy()
    iggy.down = True
    uplink = ProbedUplink(iggy)
    settings = ForwardSettings(linger_ms=0, backoff_initial_s=0.15, backoff_max_s=30.0)
    fwd = Forwarder(box, uplink, settings, metrics)
    task = asyncio.create_task(fwd.run())
    try:
        await async_wait_until(lambda: _errors(metrics) >= 6, 60, what="six failed attempts")
        uplink.heal_on_failure = True
        await async_wait_until(lambda: uplink.healed_at is not None, 60, what="the next attempt failing")
        await asyncio.wait_for(fwd.up.wait(), 30)
        assert uplink.healed_at is not None
        assert time.monotonic() - uplink.healed_at < 1.0
        await async_wait_until(lambda: box.records == 0, 10, what="the outbox drained")
        assert iggy.count("edge", "telemetry") == 5
    finally:
        fwd.stop()
        await asyncio.wait_for(task, 10)
        await box.close()
