"""SIGHUP reloads the configuration of a running `iggy-edge run` (reload.py):
what can change live is applied and logged, what needs a restart is logged
and not applied, a file that does not validate is refused and the agent
keeps running on the configuration it has."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from iggy_edge.config import parse_config
from iggy_edge.inbox_admin import read_commands
from iggy_edge.reload import plan
from iggy_edge.runtime import build_agent
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.broker import Broker
from tests.support.downlink import downlink_settings
from tests.support.mqtt import publish_all
from tests.support.ports import free_port
from tests.support.return_path import provision, send_raw
from tests.support.wait import async_wait_until, wait_until

AGENT = Path(sys.executable).parent / "iggy-edge"


def _config(tmp_path: Path, broker: Broker, metrics_port: int, **extra: str) -> str:
    buffer = extra.get("buffer", "")
    return (
        f'gateway_id = "gw-reload"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {extra.get("mqtt_port", broker.port)}\n'
        f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n'
        f'[logging]\nlevel = "{extra.get("level", "INFO")}"\n'
        f"[buffer]\n{buffer}\n"
    )


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return bool(json.loads(resp.read())["ingest"] == "up")
    except OSError:
        return False


@pytest.mark.slow
def test_sighup_applies_live_changes_refuses_a_bad_file_and_keeps_running(
    tmp_path: Path, broker: Broker
) -> None:
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(_config(tmp_path, broker, port))
    log_path = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IGGY_", "JOURNAL_STREAM"))}
    with log_path.open("wb") as log_file:
        agent = subprocess.Popen(
            [str(AGENT), "run", "-c", str(config)], stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
        try:
            wait_until(lambda: _healthy(port), 20, what="agent up")
            # a live change (the bound), one that needs a restart (the broker port), the log level
            config.write_text(
                _config(tmp_path, broker, port, buffer="max_records = 5", mqtt_port="1", level="DEBUG")
            )
            agent.send_signal(signal.SIGHUP)
            wait_until(lambda: b"reload: applied" in log_path.read_bytes(), 10, what="reload applied")
            text = log_path.read_text()
            assert "buffer.max_records 5000000 -> 5" in text
            assert "logging.level 'INFO' -> 'DEBUG'" in text
            assert "need a restart and were NOT applied" in text
            assert "mqtt.port" in text.split("NOT applied", 1)[1]
            # the new bound holds, the old broker port is still the one in use
            readings = [(f"edge/d{i}/up/env", b"1") for i in range(20)]
            asyncio.run(publish_all(broker.host, broker.port, "t-reload", readings))
            dropped = 'iggy_edge_store_dropped_records_total{reason="buffer_full_oldest"}'
            wait_until(lambda: _metric(port, dropped) >= 15, 10, what="15 of 20 dropped at the new bound")
            assert _metric(port, "iggy_edge_store_backlog_records") == 5
            assert _healthy(port)
            # a file that does not validate changes nothing
            config.write_text("gateway_id = 42\n[buffer]\nmax_records = -1\n")
            agent.send_signal(signal.SIGHUP)
            wait_until(lambda: b"reload refused" in log_path.read_bytes(), 10, what="reload refused")
            assert agent.poll() is None
            assert _healthy(port)
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(20) == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    assert "Traceback" not in log_path.read_text()


def test_plan_says_what_a_reload_takes(tmp_path: Path) -> None:
    base = {"gateway_id": "gw", "state_dir": str(tmp_path)}
    running = parse_config(base, source="t", env={})
    new = parse_config(
        base
        | {
            "buffer": {"ttl_s": 60, "synchronous": "normal"},
            "mqtt": {"password": "s3cret-pass"},
            "routes": [{"filter": "x/#", "stream": "s", "topic": "t"}],
        },
        source="t",
        env={},
    )
    p = plan(running, new)
    assert [c.key for c in p.live] == ["buffer.ttl_s", "routes"]
    assert [c.key for c in p.restart] == ["buffer.synchronous", "mqtt.password"]
    assert "s3cret" not in " ".join(map(str, p.restart))
    assert p.settings.buffer.ttl_s == 60
    assert p.settings.buffer.synchronous == running.buffer.synchronous
    assert p.settings.routes == new.routes
    assert p.settings.mqtt.password == running.mqtt.password
    assert not plan(running, running).changed


def test_config_check_against_the_running_file_says_what_a_reload_takes(tmp_path: Path) -> None:
    running = tmp_path / "running.toml"
    new = tmp_path / "new.toml"
    base = f'gateway_id = "gw"\nstate_dir = "{tmp_path}"\n'
    running.write_text(base)
    new.write_text(base + "[buffer]\nttl_s = 60\n[mqtt]\nport = 8883\n")
    out = subprocess.run(
        [str(AGENT), "config", "check", str(new), "--against", str(running)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    taken, restart = out.stdout.split("needs a restart (1):")
    assert "a reload takes (1):\n  buffer.ttl_s 604800 -> 60" in taken
    assert "mqtt.port 1883 -> 8883" in restart


def test_the_unit_reloads_with_sighup() -> None:
    from iggy_edge.service_unit import UNIT  # noqa: PLC0415 - the copy `service install` writes

    packaged = (Path(__file__).resolve().parents[1] / "packaging/systemd/iggy-edge.service").read_text()
    for unit in (packaged, UNIT):
        assert "ExecReload=/bin/kill -HUP $MAINPID" in unit


async def test_a_reload_reaches_the_return_path(broker: Broker, tmp_path: Path) -> None:
    """downlink.default_ttl_s is read by the return poll at every command: a
    command without expires_at that arrives after the reload gets the new TTL."""

    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    provision(iggy, settings)
    agent = build_agent(
        settings, uplink=iggy.uplink(), command_source=iggy.command_source(consumer_name(settings))
    )
    task = asyncio.create_task(agent.run())

    def send(cid: str) -> None:
        doc = {"id": cid, "device": "dev-1", "name": "blink", "created_at": 1_900_000_000}
        send_raw(iggy, settings, json.dumps(doc).encode())

    def ttl_of(cid: str) -> float | None:
        rows = {r.id: r for r in read_commands(settings.buffer_path)}
        return None if cid not in rows else rows[cid].expires_at - rows[cid].created_at

    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        send("before")
        await async_wait_until(lambda: ttl_of("before") is not None, 10, what="the first command stored")
        new = downlink_settings(tmp_path, broker, downlink={"default_ttl_s": 42})
        result = agent.reload(new)
        assert [c.key for c in result.live] == ["downlink.default_ttl_s"]
        send("after")
        await async_wait_until(lambda: ttl_of("after") is not None, 10, what="the second command stored")
    finally:
        agent.stop()
        await asyncio.wait_for(task, 15)
    assert ttl_of("before") == settings.downlink.default_ttl_s
    assert ttl_of("after") == 42
