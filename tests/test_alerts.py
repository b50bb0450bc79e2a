"""The shipped Prometheus alert rules and Grafana dashboard: the rules pass
`promtool check rules`, fire on the series they are meant for (`promtool
test rules`), and every metric they or the dashboard name is one a running
agent exports."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from iggy_edge.httpd import http_endpoint
from iggy_edge.runtime import Agent, return_path
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.agent import wait_subscribed
from tests.support.broker import Broker
from tests.support.downlink import downlink_settings
from tests.support.mqtt import publish_all
from tests.support.ports import free_port
from tests.support.wait import async_wait_until

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "packaging" / "prometheus" / "iggy-edge.rules.yml"
DASHBOARD = ROOT / "packaging" / "grafana" / "iggy-edge-dashboard.json"
UNIT_TESTS = Path(__file__).parent / "data" / "alerts_test.yml"
METRIC = re.compile(r"\biggy_edge_[a-z0-9_]+")


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: run .ci/setup (Debian's prometheus package)")
    return binary


def test_rules_pass_promtool_check() -> None:
    out = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 9 rules found" in out.stdout


def test_rules_fire_on_the_series_they_are_for(tmp_path: Path) -> None:
    tests = tmp_path / "rules_test.yml"
    tests.write_text(UNIT_TESTS.read_text().replace("[RULES]", json.dumps([str(RULES)])))
    out = subprocess.run(
        [_promtool(), "test", "rules", str(tests)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def _named(text: str) -> set[str]:
    return set(METRIC.findall(text))


def _exported(exposition: str) -> set[str]:
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


async def test_every_metric_the_rules_and_the_dashboard_name_is_exported(
    broker: Broker, tmp_path: Path
) -> None:
    port = free_port()
    settings = downlink_settings(tmp_path, broker, metrics={"enabled": True, "listen": f"127.0.0.1:{port}"})
    iggy = MemoryIggy()

    agent = Agent(
        settings,
        uplink=iggy.uplink(),
        command_source=iggy.command_source(consumer_name(settings)),
        components=(http_endpoint, return_path),
    )
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        await wait_subscribed(agent)
        await publish_all(broker.host, broker.port, "t-alerts", [("edge/dev-1/up/env", b'{"seq":1,"t":1}')])
        await async_wait_until(lambda: len(agent.devices) == 1, 10, what="a device seen")
        exposition = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
    finally:
        agent.stop()
        await asyncio.wait_for(task, 15)
    exported = _exported(exposition)
    named = _named(RULES.read_text()) | _named(DASHBOARD.read_text())
    assert len(named) >= 20
    assert sorted(named - exported) == []


def test_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "instance"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in doc["panels"])
    assert all(t["expr"] for p in doc["panels"] for t in p["targets"])
