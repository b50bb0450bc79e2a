"""`iggy-edge device list`: every device the running agent heard from."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import typer
from iggy_edge.cli.device_view import parse_duration
from iggy_edge.cli.main import app
from iggy_edge.httpd import http_endpoint
from iggy_edge.uplink.memory import MemoryIggy
from typer.testing import CliRunner

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import publish_all
from tests.support.ports import free_port
from tests.support.wait import async_wait_until


@pytest.mark.unit
def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "10m", "2h", "1d", "1.5m")] == [
        90,
        90,
        600,
        7200,
        86400,
        90,
    ]
    with pytest.raises(typer.BadParameter):
        parse_duration("ten minutes")


async def test_list_stale_device_and_json(broker: Broker, tmp_path: Path) -> None:
    port = free_port()
    metrics = {"enabled": True, "listen": f"127.0.0.1:{port}", "device_stale_s": 2.0}
    settings = make_settings(tmp_path, broker, metrics=metrics)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'gateway_id = "gw-test"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    )
    runner = CliRunner()

    def cli(*args: str) -> str:
        result = runner.invoke(app, ["device", "list", "-c", str(cfg), *args])
        assert result.exit_code == 0, result.output
        return result.output

    async with running_agent(settings, MemoryIggy().uplink(), components=(http_endpoint,)) as agent:
        await publish_all(broker.host, broker.port, "t1", [("edge/old-1/up/env", b"1")])
        await asyncio.sleep(2.5)
        await publish_all(
            broker.host, broker.port, "t2", [("edge/new-1/up/env", b"22"), ("edge/new-1/up/env", b"")]
        )
        await async_wait_until(lambda: len(agent.devices) == 2, 10, what="two devices")
        listing = await asyncio.to_thread(cli)
        stale = await asyncio.to_thread(cli, "--stale", "2s")
        one = await asyncio.to_thread(cli, "--device", "new-1")
        doc = json.loads(await asyncio.to_thread(cli, "--json"))
    lines = listing.splitlines()
    assert lines[0] == "2 device(s), 1 stale (silent over 2s), stalest first"
    assert lines[2].startswith("old-1 ")
    assert lines[2].endswith("STALE")
    assert lines[3].startswith("new-1 ")
    assert "empty_payload 1" in lines[3]
    assert [line.split()[0] for line in stale.splitlines()[2:]] == ["old-1"]
    assert "device        new-1" in one
    assert "readings      1 (2 bytes)" in one
    assert [d["device"] for d in doc["devices"]] == ["old-1", "new-1"]
    assert doc["devices"][0]["stale"] is True


@pytest.mark.unit
def test_no_agent_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'gateway_id = "gw"\nstate_dir = "{tmp_path}"\n[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
    )
    result = CliRunner().invoke(app, ["device", "list", "-c", str(cfg)])
    assert result.exit_code == 3
    assert "does not answer" in result.output
