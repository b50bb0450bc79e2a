"""Settings and a running in-process Agent for tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from iggy_edge.config import Settings, parse_config
from iggy_edge.runtime import Agent
from iggy_edge.uplink.protocol import Uplink

from .broker import Broker
from .wait import async_wait_until


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_settings(tmp_path: Path, broker: Broker | None = None, **overrides: Any) -> Settings:
    """Test settings: a private state dir, the test's broker, fast commits and
    backoff; the real environment is ignored (env={})."""
    raw: dict[str, Any] = {
        "gateway_id": "gw-test",
        "state_dir": str(tmp_path / "state"),
        "mqtt": {"reconnect_min_s": 0.1, "reconnect_max_s": 0.5},
        "forward": {"linger_ms": 5, "backoff_initial_s": 0.05, "backoff_max_s": 0.2},
    }
    if broker is not None:
        raw["mqtt"].update({"host": broker.host, "port": broker.port})
    return parse_config(_merge(raw, overrides), source="test", env={})


async def wait_subscribed(agent: Agent, timeout: float = 10.0) -> None:
    """Until the agent's MQTT session is up and every SUBSCRIBE was acknowledged."""

    def subscribed() -> bool:
        ingest = agent.ingest
        client = None if ingest is None else ingest.client
        return (
            client is not None
            and ingest is not None
            and ingest.connected.is_set()
            and bool(client.subscriptions)
            and all(s.acknowledged for s in client.subscriptions)
        )

    await async_wait_until(subscribed, timeout, what="agent subscribed")


@contextlib.asynccontextmanager
async def running_agent(
    settings: Settings, uplink: Uplink | None = None, *, stop_timeout: float = 15.0, **kw: Any
) -> AsyncIterator[Agent]:
    """An Agent running in this loop, subscribed; stopped (and awaited) on exit."""
    agent = Agent(settings, uplink=uplink, **kw)
    task = asyncio.create_task(agent.run(), name="agent-under-test")
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        await wait_subscribed(agent)
        yield agent
    finally:
        agent.stop()
        await asyncio.wait_for(task, stop_timeout)
