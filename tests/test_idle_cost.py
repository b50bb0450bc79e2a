"""An idle gateway pays for nothing but its one poll a second (issue 23):
the forwarder waits on the outbox's commit event instead of re-reading the
outbox, and the return poll's round does not count the inbox while the
count cannot matter.  bench/idle_bench.py measures what that saves."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.config import Settings, parse_config
from iggy_edge.downlink.commands import make_command
from iggy_edge.downlink.deliver import Deliverer
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.poll import ReturnPoll
from iggy_edge.forward import Forwarder
from iggy_edge.inbox_admin import read_offsets
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.memory import MemoryCommandSource, MemoryIggy
from iggy_edge.uplink.protocol import UplinkRejected

from tests.support.broker import Broker
from tests.support.downlink import downlink_settings
from tests.support.return_path import device, provision, running, send, states, stored_offset
from tests.support.wait import async_wait_until

ROUTE = Route("edge", "telemetry", "dev-1")


def _incoming(i: int) -> Incoming:
    return Incoming(ROUTE, "edge/dev-1/up/env", 1, False, time.time_ns() // 1000, b"%d" % i, i)


def _counted(obj: Any, name: str) -> list[float]:
    """Replace obj.name (a coroutine method) by one that notes each call's time."""
    calls: list[float] = []
    real = getattr(obj, name)

    async def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        return await real(*args, **kwargs)

    setattr(obj, name, counting)
    return calls


@pytest.mark.unit
async def test_an_idle_forwarder_reads_nothing_and_a_commit_wakes_it_at_once(tmp_path: Path) -> None:
    settings = parse_config({"gateway_id": "gw-idle", "state_dir": str(tmp_path)}, env={})
    metrics = Metrics()
    box = await Outbox.open(settings.buffer_path, settings.buffer, "gw-idle", metrics)
    box.start()
    iggy = MemoryIggy()
    fwd = Forwarder(box, iggy.uplink(), settings.forward, metrics)
    reads = _counted(box, "read_batch")
    task = asyncio.create_task(fwd.run())
    try:
        await box.submit(_incoming(1))
        await async_wait_until(lambda: iggy.count("edge", "telemetry") == 1, what="the first record")
        await asyncio.sleep(0.3)  # the read that found nothing more is behind it
        before = len(reads)
        await asyncio.sleep(1.5)
        assert len(reads) == before, "an idle forwarder re-read its outbox"
        t0 = time.monotonic()
        await box.submit(_incoming(2))
        await async_wait_until(lambda: iggy.count("edge", "telemetry") == 2, what="the second record")
        # woken by the commit, not by a timer (linger 5 ms, commit interval 10 ms)
        assert time.monotonic() - t0 < 0.4
        t0 = time.monotonic()
        fwd.stop()
        await asyncio.wait_for(task, 5)
        assert time.monotonic() - t0 < 0.5  # a stop wakes the idle wait too
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await box.close()


async def _return_side(
    tmp_path: Path, poll_interval_s: float
) -> tuple[Settings, Metrics, Outbox, Inbox, MemoryIggy, MemoryCommandSource, list[float]]:
    """A gateway's return-path side on a fresh buffer over `MemoryIggy`: its
    settings, metrics, outbox (started), inbox, the Iggy stand-in, the command
    source and the time of each of its polls.  The caller closes inbox and outbox."""
    settings = parse_config(
        {
            "gateway_id": "gw-idle",
            "state_dir": str(tmp_path),
            "iggy": {"kind": "memory"},
            "downlink": {"poll_interval_s": poll_interval_s},
        },
        env={},
    )
    metrics = Metrics()
    box = await Outbox.open(settings.buffer_path, settings.buffer, "gw-idle", metrics)
    box.start()
    inbox = await Inbox.open(settings.buffer_path, settings)
    iggy = MemoryIggy()
    provision(iggy, settings)
    source = iggy.command_source()
    return settings, metrics, box, inbox, iggy, source, _counted(source, "poll")


@pytest.mark.unit
async def test_an_idle_return_poll_round_is_the_poll_alone(tmp_path: Path) -> None:
    settings, metrics, box, inbox, iggy, source, polls = await _return_side(tmp_path, 0.05)
    statements = _counted(inbox._db, "fetchall")  # noqa: SLF001 - every statement the inbox runs
    poll = ReturnPoll(settings, source, inbox, box, metrics)
    task = asyncio.create_task(poll.run())
    try:
        await async_wait_until(lambda: len(polls) >= 3, what="three polls")
        before, polled = len(statements), len(polls)
        await asyncio.sleep(0.5)
        assert len(polls) >= polled + 5  # it goes on polling, 20 a second here
        assert len(statements) == before, "an idle round read the inbox"
        send(iggy, settings, make_command("dev-1", "go", {}))
        await async_wait_until(lambda: metrics.value("iggy_edge_downlink_inbox_records") == 1, what="stored")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await inbox.close()
        await box.close()


async def test_with_the_inbox_bound_a_full_inbox_still_pauses_and_resumes(
    tmp_path: Path, broker: Broker
) -> None:
    """max_inbox 10, 2 commands a poll: the rounds run on the bound while it
    leaves room for a whole batch, yet the poll stops at 10 waiting, and once
    the deliverer took them (the bound is then too high) it counts again and
    takes the rest, in order."""
    settings = downlink_settings(
        tmp_path, broker, downlink={"max_inbox": 10, "poll_batch": 2, "poll_interval_s": 0.05}
    )
    iggy = MemoryIggy()
    broker.stop()  # nothing is delivered: the inbox fills up
    cmds = [make_command("dev-1", "step", {"i": i}) for i in range(13)]
    async with running(settings, iggy) as r:
        for c in cmds:
            send(iggy, settings, c)
        await async_wait_until(lambda: r.metric("iggy_edge_downlink_inbox_full_total") >= 2, what="paused")
        assert list(states(settings)) == [c.id for c in cmds[:10]]
        assert stored_offset(settings) == 9  # the other 3 are still only in Iggy
        assert r.metric("iggy_edge_downlink_inbox_records") == 10
        broker.start()
        async with device(broker) as dev:
            await async_wait_until(lambda: len(dev.ids()) == 13, timeout=20, what="all 13 delivered")
            assert dev.ids() == [c.id for c in cmds]


@pytest.mark.unit
async def test_a_failing_offset_mirror_backs_off_instead_of_retrying_every_round(tmp_path: Path) -> None:
    """The fast cadence after a command runs 20 rounds per interval; a mirror
    the server refuses is tried again after a backoff, not every round, and
    goes through once the server takes it."""
    settings, metrics, box, inbox, iggy, source, polls = await _return_side(tmp_path, 0.5)
    tries: list[float] = []
    real_mirror = source.mirror_offset
    refuse = True

    async def mirror(stream: str, topic: str, partition_id: int, offset: int) -> None:
        tries.append(time.monotonic())
        if refuse:
            raise UplinkRejected("rejecting client request on non-primary partition replica")
        await real_mirror(stream, topic, partition_id, offset)

    source.mirror_offset = mirror  # type: ignore[method-assign]
    poll = ReturnPoll(settings, source, inbox, box, metrics)
    task = asyncio.create_task(poll.run())
    try:
        await async_wait_until(lambda: polls, what="the first poll")
        send(iggy, settings, make_command("dev-1", "go", {}))
        await async_wait_until(lambda: tries, what="the first mirror")
        polled = len(polls)
        await asyncio.sleep(1.2)  # in the fast cadence: a round every 25 ms
        assert len(polls) - polled >= 20
        assert len(tries) <= 6, f"{len(tries)} tries of a refused mirror in 1.2 s"
        refuse = False
        await async_wait_until(
            lambda: [o[4] for o in read_offsets(settings.buffer_path)] == [0], timeout=10, what="mirrored"
        )
        assert metrics.value("iggy_edge_downlink_errors_total", kind="mirror") == len(tries) - 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await inbox.close()
        await box.close()


async def test_an_idle_deliverer_asks_sqlite_nothing_and_a_stored_command_wakes_it(
    tmp_path: Path, broker: Broker
) -> None:
    """Connected and with nothing due, the deliverer ran five statements a
    second (due configs, due commands, due restores, the gauge, and the expiry
    sweep, a write).  Now one look says nothing waits, and until a write only
    SQLite's data_version is read, once a second; the command the poll stores
    and wakes it for still goes out at once, and one that expires while the
    broker is away is swept."""
    settings = downlink_settings(tmp_path, broker, downlink={"default_ttl_s": 1})
    metrics = Metrics()
    box = await Outbox.open(settings.buffer_path, settings.buffer, settings.gateway_id, metrics)
    inbox = await Inbox.open(settings.buffer_path, settings)
    reads = _counted(inbox._db, "fetchall")  # noqa: SLF001 - every read the inbox runs
    writes: list[float] = []
    real_write = inbox._db.write  # noqa: SLF001

    def counting_write() -> Any:
        writes.append(time.monotonic())
        return real_write()

    inbox._db.write = counting_write  # type: ignore[method-assign]  # noqa: SLF001
    deliverer = Deliverer(settings, inbox, metrics)
    task = asyncio.create_task(deliverer.run())
    try:
        async with device(broker) as dev:
            await async_wait_until(lambda: deliverer.connected_since is not None, what="connected")
            await asyncio.sleep(0.5)  # its first look is behind it
            before = (len(reads), len(writes))
            await asyncio.sleep(2.2)
            assert len(writes) == before[1], "an idle deliverer wrote"
            assert len(reads) - before[0] <= 3, "more than its one look a second"
            cmd = make_command("dev-1", "go", {})
            await inbox.store_polled("edge-rp-0", "return", 0, 0, [(cmd, "return/0@0")])
            t0 = time.monotonic()
            deliverer.wake()
            await async_wait_until(lambda: dev.ids() == [cmd.id], timeout=5, what="delivered")
            assert time.monotonic() - t0 < 0.5, "woken by the store, not by a timer"
            # marked once the broker's PUBACK is back, just after the device has it
            marked = {cmd.id: "delivered"}
            await async_wait_until(lambda: states(settings) == marked, timeout=5, what="marked delivered")
        broker.stop()  # disconnected, it sweeps for expired commands every second: none while none wait
        await async_wait_until(lambda: deliverer.connected_since is None, timeout=10, what="disconnected")
        await asyncio.sleep(1.2)  # its first sweep looks once
        before = (len(reads), len(writes))
        await asyncio.sleep(2.2)
        assert len(writes) == before[1], "a disconnected idle deliverer wrote"
        assert len(reads) - before[0] <= 3, "more than its one look a second"
        late = make_command("dev-1", "late", {}, ttl_s=1)
        await inbox.store_polled("edge-rp-0", "return", 0, 1, [(late, "return/0@1")])
        deliverer.wake()
        await async_wait_until(lambda: states(settings).get(late.id) == "expired", timeout=5, what="swept")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await inbox.close()
        await box.close()
