"""The real agent with its updater (short timeouts), and requests written
into its ota.db as the CLI writes them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from iggy_edge.config import Settings
from iggy_edge.ota import requests as req
from iggy_edge.ota.artifact import Artifact
from iggy_edge.ota.component import updates_with
from iggy_edge.ota.updater import Limits
from iggy_edge.runtime import Agent, return_path
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.memory import MemoryIggy

from .agent import make_settings, wait_subscribed
from .broker import Broker
from .wait import async_wait_until

FAST = Limits(resend_s=0.4, resend_max_s=1.0, stall_s=20.0, switch_s=20.0, tick_s=0.05)


def ota_settings(tmp_path: Path, broker: Broker) -> Settings:
    return make_settings(
        tmp_path,
        broker,
        iggy={"kind": "memory"},
        downlink={"poll_interval_s": 0.05},
        metrics={"enabled": False},
    )


def app(version: str = "v1", size: int = 5000, mpy: int | None = None) -> Artifact:
    """A small app of two files (the second spans several chunks)."""
    body = bytes((i * 7 + len(version)) % 251 for i in range(size))
    return Artifact(version, (("main.py", b"import app\n"), ("app.py", body)), mpy, "test")


def request_now(settings: Settings, art: Artifact, waves: list[list[str]], **kw: Any) -> req.Requested:
    conn = req.connect(req.db_path(settings.state_dir))
    try:
        req.put_artifact(conn, art)
        return req.request(conn, art.id, waves, **kw)
    finally:
        conn.close()


async def request(settings: Settings, art: Artifact, waves: list[list[str]], **kw: Any) -> req.Requested:
    """As the CLI does, from another thread: the agent's loop must go on
    (a blocking write here would wait for the agent's transaction, whose
    commit waits for this loop)."""
    return await asyncio.to_thread(request_now, settings, art, waves, **kw)


def rows(settings: Settings) -> dict[str, dict[str, Any]]:
    """device -> its newest update row."""
    conn = req.connect_ro(req.db_path(settings.state_dir))
    try:
        out: dict[str, dict[str, Any]] = {}
        for r in req.rows(conn, limit=1000):
            out.setdefault(r["device"], r)
        return out
    finally:
        conn.close()


def state_of(settings: Settings, device: str) -> str | None:
    row = rows(settings).get(device)
    return None if row is None else row["state"]


class RunningAgent:
    """The agent with its updater; with `return_path`, the return poll too
    (which hands the cloud side's ``kind = ota`` messages to ota/cloud.py)."""

    def __init__(
        self, settings: Settings, iggy: MemoryIggy, limits: Limits, *, with_return_path: bool
    ) -> None:
        self.agent = Agent(
            settings,
            uplink=iggy.uplink(),
            command_source=iggy.command_source(consumer_name(settings)),
            components=(updates_with(limits), return_path) if with_return_path else (updates_with(limits),),
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> RunningAgent:
        self.task = asyncio.create_task(self.agent.run(), name="agent-under-test")
        await asyncio.wait_for(self.agent.ready.wait(), 10)
        await wait_subscribed(self.agent)
        return self

    def metric(self, name: str, **labels: str) -> float:
        return self.agent.metrics.value(name, **labels)

    async def stop(self) -> None:
        assert self.task is not None
        if not self.task.done():
            self.agent.stop()
            await asyncio.wait_for(self.task, 15)

    async def hard_kill(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@contextlib.asynccontextmanager
async def running(
    settings: Settings,
    iggy: MemoryIggy | None = None,
    limits: Limits = FAST,
    *,
    with_return_path: bool = False,
) -> AsyncIterator[RunningAgent]:
    r = await RunningAgent(settings, iggy or MemoryIggy(), limits, with_return_path=with_return_path).start()
    try:
        yield r
    finally:
        await r.stop()


async def wait_state(settings: Settings, device: str, *states: str, timeout: float = 20.0) -> None:
    await async_wait_until(
        lambda: state_of(settings, device) in states,
        timeout,
        what=f"{device} in {states} (is {state_of(settings, device)})",
    )


def stored_headers(iggy: MemoryIggy) -> list[str]:
    """Every header value of every record the agent forwarded (the MQTT topic among them)."""
    return [
        str(v)
        for parts in iggy.topics.values()
        for p in parts
        for r in p.records
        if r is not None
        for v in r.headers.values()
    ]
