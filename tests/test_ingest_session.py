"""The broker forgetting the agent's persistent session (issue 8 item 5),
against a real Mosquitto: SIGKILLed with persistence off, it comes back
without the session, and the agent says so (log, metric, health) -- both
while running and after its own restart.  A broker that kept the session
(persistence on, orderly restart) raises no alarm."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from iggy_edge.cli.main import app
from iggy_edge.httpd import http_endpoint
from iggy_edge.runtime import Agent
from typer.testing import CliRunner

from tests.support.agent import make_settings, running_agent, wait_subscribed
from tests.support.broker import Broker
from tests.support.ports import free_port
from tests.support.wait import async_wait_until

LOST = "iggy_edge_mqtt_session_lost_total"


async def reconnected(agent: Agent, reconnects_before: float) -> None:
    await async_wait_until(
        lambda: agent.metrics.value("iggy_edge_ingest_reconnects_total") > reconnects_before,
        20,
        what="ingest noticed the broker went away",
    )
    await wait_subscribed(agent, 30)


async def test_broker_crash_without_persistence_is_a_lost_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker = Broker(tmp_path / "broker", persistence=False).start()
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(
        f'gateway_id = "gw-test"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    )
    try:
        settings = make_settings(tmp_path, broker, metrics={"listen": f"127.0.0.1:{port}"})
        async with running_agent(settings, components=(http_endpoint,)) as agent:
            assert agent.metrics.value(LOST) == 0  # the first session ever: nothing to lose
            before = agent.metrics.value("iggy_edge_ingest_reconnects_total")
            broker.kill()
            broker.start()
            await reconnected(agent, before)
            assert agent.metrics.value(LOST) == 1
            assert agent.health().as_dict()["mqtt_sessions_lost"] == 1
            assert "had forgotten the agent's session" in caplog.text
            runner = CliRunner()
            status = await asyncio.to_thread(runner.invoke, app, ["status", "-c", str(config), "--json"])
            doc = json.loads(status.stdout)
            assert doc["ingest"]["sessions_lost"] == 1
            assert doc["health"]["mqtt_sessions_lost"] == 1
            once = await asyncio.to_thread(runner.invoke, app, ["status", "-c", str(config), "--once"])
            assert "1 MQTT sessions lost" in once.stdout
        # The agent restarts (new process state, same buffer) after another crash.
        broker.kill()
        broker.start()
        async with running_agent(settings) as agent:
            assert agent.metrics.value(LOST) == 1, "the outbox remembers the agent had a session"
    finally:
        broker.stop()


async def test_a_kept_session_raises_no_alarm(
    tmp_path: Path, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings) as agent:
        before = agent.metrics.value("iggy_edge_ingest_reconnects_total")
        broker.restart()  # SIGTERM: Mosquitto saves its persistence file
        await reconnected(agent, before)
        assert agent.metrics.value(LOST) == 0
    async with running_agent(settings) as agent:
        assert agent.metrics.value(LOST) == 0
        assert agent.health().mqtt_sessions_lost == 0
    assert "forgotten" not in caplog.text
