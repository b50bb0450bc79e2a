"""The supervisor restarts a failed stage on every Python the package
supports, and /health and `status` say which stage is not running.

A stage that fails inside a TaskGroup (the return path runs its poll,
deliverer and ack listener in one) left its parent task with a raised
cancel count; on Python 3.11.2, Debian 12's /usr/bin/python3 and so what the
.deb runs, the supervisor's backoff wait then raised CancelledError and the
stage was never restarted.  .ci/test runs this file on /usr/bin/python3 too.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from iggy_edge.cli.status import render
from iggy_edge.downlink.commands import make_command
from iggy_edge.metrics import Metrics
from iggy_edge.runtime import Agent, build_agent
from iggy_edge.scrape import Snapshot, figures
from iggy_edge.supervisor import Supervisor
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.memory import MemoryCommandSource, MemoryIggy
from iggy_edge.uplink.protocol import PolledMessage
from rich.console import Console

from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, downlink_settings
from tests.support.ports import free_port
from tests.support.return_path import provision, send
from tests.support.wait import async_wait_until


def http_get(agent: Agent, path: str) -> tuple[int, str]:
    url = f"http://{agent.settings.metrics.listen}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class FailsOnce(MemoryCommandSource):
    """A command source whose first poll raises an error the return poll
    does not expect (what an SDK change or a bug would do)."""

    def __init__(self, iggy: MemoryIggy, consumer: str) -> None:
        super().__init__(iggy, consumer)
        self.failed = False

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        if not self.failed:
            self.failed = True
            raise KeyError("an error nobody expected")
        return await super().poll(stream, topic, partition_id, offset, count)


async def test_return_path_that_fails_in_its_task_group_is_restarted_and_health_says_so(
    broker: Broker, tmp_path: Path
) -> None:
    settings = downlink_settings(
        tmp_path, broker, metrics={"enabled": True, "listen": f"127.0.0.1:{free_port()}"}
    )
    iggy = MemoryIggy()
    provision(iggy, settings)
    source = FailsOnce(iggy, consumer_name(settings))
    agent = build_agent(settings, uplink=iggy.uplink(), command_source=source)
    device = await DeviceSubscriber(broker.host, broker.port, "edge/dev-1/down/cmd").start()
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        await async_wait_until(lambda: source.failed, 10, what="the failing poll")
        await async_wait_until(
            lambda: agent.health().stages.get("return_path", "").startswith("failing"),
            5,
            what="the return path reported failing",
        )
        health = agent.health()
        assert not health.healthy
        assert "KeyError" in health.stages["return_path"], health.stages
        assert health.stages["ingest"] == "running"
        assert (await asyncio.to_thread(http_get, agent, "/health"))[0] == 503
        metrics = (await asyncio.to_thread(http_get, agent, "/metrics"))[1]
        assert 'iggy_edge_agent_stage_failing{stage="return_path"} 1.0' in metrics

        cmd = make_command("dev-1", "blink")
        send(iggy, settings, cmd)
        # Restarted after its backoff (at most 2 s for the first restart).
        await async_wait_until(lambda: device.messages, 15, what=f"the command delivered ({sys.version})")
        assert device.messages[0].doc["id"] == cmd.id
        assert agent.metrics.value("iggy_edge_agent_stage_restarts_total", stage="return_path") == 1
        # Still reported until it has run STABLE_S without failing again.
        assert agent.health().stages["return_path"].startswith("failing (1 failures")
    finally:
        agent.stop()
        await asyncio.wait_for(task, 15)
        await device.stop()


async def test_a_stage_failing_before_its_first_wait_and_one_that_cancels_itself_are_restarted() -> None:
    """Two edge cases of the per-attempt task: an exception raised before
    the stage ever awaited, and a stage that ends with a CancelledError that
    the supervisor did not ask for (the 3.11.2 symptom, from inside)."""
    stop = asyncio.Event()
    sup = Supervisor(stop, Metrics(), backoff_initial_s=0.01, backoff_max_s=0.02)
    calls: list[int] = []

    async def stage() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("at once")
        if len(calls) == 2:
            raise asyncio.CancelledError
        await stop.wait()

    task = asyncio.create_task(sup.supervise("s", stage))
    await async_wait_until(lambda: len(calls) == 3, 5, what="third attempt")
    assert sup.states()["s"].startswith("failing (2 failures, last: the stage ended with CancelledError")
    stop.set()
    await asyncio.wait_for(task, 5)
    assert sup.states()["s"] == "ended"


async def test_cancelling_the_supervisor_cancels_the_running_attempt() -> None:
    stop = asyncio.Event()
    sup = Supervisor(stop, Metrics())
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def stage() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    task = asyncio.create_task(sup.supervise("s", stage))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert cancelled.is_set()


def test_status_names_a_failing_stage() -> None:
    health = {
        "gateway": "gw",
        "ingest": "up",
        "uplink": "up",
        "store": "ok",
        "stages": {"ingest": "running", "return_path": "failing (3 failures, last: KeyError: 'x')"},
    }
    snap = Snapshot(0.0, {}, {}, health, False)
    console = Console(width=200, record=True)
    console.print(render(figures(snap), "test"))
    text = console.export_text()
    assert "UNHEALTHY" in text
    assert "return_path failing (3 failures, last: KeyError: 'x')" in text
    # an agent from before this field: nothing claimed either way
    snap = Snapshot(0.0, {}, {}, {k: v for k, v in health.items() if k != "stages"}, True)
    console = Console(width=200, record=True)
    console.print(render(figures(snap), "test"))
    assert "stages" not in console.export_text()
    assert json.dumps(health)  # the document as /health serves it
