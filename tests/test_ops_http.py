"""/metrics and /health scraped over HTTP while the pipeline runs (real Mosquitto,
MemoryIggy uplink), and `iggy-edge status` reading the same figures."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import pty
import select
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.cli.main import app
from iggy_edge.config import MetricsSettings, Settings, parse_listen
from iggy_edge.httpd import MetricsServer, http_endpoint, local_url
from iggy_edge.metrics import Metrics
from iggy_edge.runtime import Agent
from iggy_edge.scrape import parse_metrics
from iggy_edge.store import Outbox
from iggy_edge.uplink.memory import MemoryIggy
from typer.testing import CliRunner

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.demo import AGENT
from tests.support.mqtt import publish_all
from tests.support.ports import free_port
from tests.support.wait import async_wait_until


def _get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


async def get(url: str, method: str = "GET") -> tuple[int, str, bytes]:
    return await asyncio.to_thread(_get, url, method)


async def metrics(base: str) -> dict[str, float]:
    status, _, body = await get(f"{base}/metrics")
    assert status == 200
    return parse_metrics(body.decode())[0]


async def health(base: str) -> tuple[int, dict[str, Any]]:
    status, ctype, body = await get(f"{base}/health")
    assert ctype == "application/json"
    return status, json.loads(body)


def _settings(tmp_path: Path, broker: Broker, port: int) -> Settings:
    return make_settings(
        tmp_path,
        broker,
        metrics={"listen": f"127.0.0.1:{port}", "uplink_down_unhealthy_s": 0.5},
    )


def _config_file(tmp_path: Path, broker: Broker, port: int) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'gateway_id = "gw-test"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    )
    return path


async def test_metrics_and_health_follow_the_pipeline(tmp_path: Path, broker: Broker) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    iggy = MemoryIggy()
    settings = _settings(tmp_path, broker, port)
    async with running_agent(settings, iggy.uplink(), components=(http_endpoint,)):
        before = await metrics(base)
        assert before["iggy_edge_ingest_messages_total"] == 0
        assert before["iggy_edge_agent_healthy"] == 1
        assert before["iggy_edge_ingest_connected"] == 1

        msgs = [(f"edge/dev{i % 3}/up/env", b'{"seq": %d, "t": 20.5}' % i) for i in range(60)]
        await publish_all(broker.host, broker.port, "ops-pub-1", msgs)
        await async_wait_until(lambda: iggy.count() == 60, 15, what="60 forwarded")

        async def forwarded() -> dict[str, float]:
            m = await metrics(base)
            return m if m["iggy_edge_forward_records_total"] == 60 else {}

        m: dict[str, float] = {}
        for _ in range(100):
            m = await forwarded()
            if m:
                break
            await asyncio.sleep(0.05)
        assert m, "forwarded counter never reached 60"
        assert m["iggy_edge_ingest_messages_total"] == 60
        assert m["iggy_edge_store_records_committed_total"] == 60
        assert m["iggy_edge_forward_send_seconds_count"] >= 1
        assert m["iggy_edge_forward_uplink_up"] == 1
        assert m["iggy_edge_store_backlog_records"] == 0
        status, doc = await health(base)
        assert status == 200
        assert doc["healthy"] is True
        assert doc["ingest"] == "up"
        assert doc["uplink"] == "up"
        assert doc["gateway"] == "gw-test"

        # Uplink down: records pile up; past uplink_down_unhealthy_s health says 503.
        iggy.down = True
        await publish_all(broker.host, broker.port, "ops-pub-2", [("edge/dev9/up/env", b"x")] * 10)
        deadline = asyncio.get_running_loop().time() + 15
        while True:
            status, doc = await health(base)
            if status == 503:
                break
            assert asyncio.get_running_loop().time() < deadline, f"never unhealthy: {doc}"
            await asyncio.sleep(0.05)
        assert doc["healthy"] is False
        assert doc["uplink"].startswith("down for")
        m = await metrics(base)
        assert m["iggy_edge_store_backlog_records"] == 10
        assert m["iggy_edge_forward_uplink_up"] == 0
        assert m["iggy_edge_forward_errors_total"] >= 1
        assert m["iggy_edge_agent_healthy"] == 0

        # Back up: drains, healthy again.
        iggy.down = False
        await async_wait_until(lambda: iggy.count() == 70, 15, what="backlog drained")
        deadline = asyncio.get_running_loop().time() + 15
        while (await health(base))[0] != 200:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)


async def test_http_routes_and_methods(tmp_path: Path, broker: Broker) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    settings = _settings(tmp_path, broker, port)
    async with running_agent(settings, MemoryIggy().uplink(), components=(http_endpoint,)):
        status, ctype, body = await get(f"{base}/metrics")
        assert status == 200
        assert ctype.startswith("text/plain")
        assert b'iggy_edge_agent_info{gateway="gw-test"' in body
        assert b'iggy_edge_store_dropped_records_total{reason="buffer_full_oldest"} 0.0' in body
        assert (await get(f"{base}/nope"))[0] == 404
        assert (await get(f"{base}/metrics", "POST"))[0] == 405
        status, _, body = await get(f"{base}/health", "HEAD")
        assert status == 200
        assert body == b""
        # A client that sends garbage and hangs up does not hurt the server.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x00\x01garbage\r\n\r\n")
        await writer.drain()
        assert (await reader.read())[:12] == b"HTTP/1.0 400"
        writer.close()
        assert (await get(f"{base}/health"))[0] == 200


async def test_endpoint_binds_to_localhost_by_default(tmp_path: Path) -> None:
    """The socket the server actually bound, with the default listen host (on a
    free port: 9108 may be taken on a shared machine), is loopback only."""
    default_host, _ = parse_listen(MetricsSettings().listen)
    listen = f"{default_host}:{free_port()}"
    server = MetricsServer(Agent(make_settings(tmp_path)), listen)
    await server.start()
    try:
        bound = server.bound_addresses
        assert bound, "the server bound no socket"
        assert all(ipaddress.ip_address(host).is_loopback for host, _ in bound), bound
        assert {port for _, port in bound} == {server.port}
        # and it answers there
        status, _, _ = await get(f"{local_url(listen)}/")
        assert status == 200
    finally:
        await server.close()


async def test_status_reads_the_running_agent_and_falls_back_to_the_buffer(
    tmp_path: Path, broker: Broker
) -> None:
    port = free_port()
    config = _config_file(tmp_path, broker, port)
    iggy = MemoryIggy()
    runner = CliRunner()
    settings = _settings(tmp_path, broker, port)
    async with running_agent(settings, iggy.uplink(), components=(http_endpoint,)):
        await publish_all(broker.host, broker.port, "ops-pub-3", [("edge/d1/up/t", b"1")] * 25)
        await async_wait_until(lambda: iggy.count() == 25, 15)

        def forwarded_in_status() -> dict[str, Any]:
            result = runner.invoke(app, ["status", "-c", str(config), "--json"])
            assert result.exit_code == 0, result.output
            doc: dict[str, Any] = json.loads(result.stdout)
            return doc

        doc: dict[str, Any] = {}
        for _ in range(100):
            doc = await asyncio.to_thread(forwarded_in_status)
            if doc["forward"]["records"] == 25:
                break
            await asyncio.sleep(0.05)
        assert doc["agent"] == "running"
        assert doc["ingest"]["messages"] == 25
        assert doc["forward"]["records"] == 25
        assert doc["healthy"] is True
        once = await asyncio.to_thread(runner.invoke, app, ["status", "-c", str(config), "--once"])
        assert once.exit_code == 0, once.output
        assert "healthy" in once.stdout
        assert "forwarded" in once.stdout

    # Agent stopped: exit 3 and the buffer read from SQLite.
    result = runner.invoke(app, ["status", "-c", str(config), "--json"])
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["agent"] == "not running"
    assert doc["buffer"]["records"] == 0
    text = runner.invoke(app, ["status", "-c", str(config)])
    assert text.exit_code == 3
    assert "not running" in text.stdout
    assert "systemctl start iggy-edge" in text.stdout


async def test_port_taken_is_logged_without_traceback_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds metrics.listen: the HTTP component says so in one
    line (no traceback, no crash loop) and binds once the port is free."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    agent = Agent(make_settings(tmp_path, metrics={"listen": f"127.0.0.1:{port}"}))
    with caplog.at_level(logging.ERROR, logger="iggy_edge.httpd"):
        task = asyncio.create_task(http_endpoint(agent))
        try:
            await async_wait_until(
                lambda: any("cannot serve /metrics" in r.getMessage() for r in caplog.records),
                10,
                what="bind failure logged",
            )
            assert all(r.exc_info is None for r in caplog.records)
            assert not task.done()
            holder.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while not await _answers(port):
                assert loop.time() < deadline, "endpoint never bound once the port was free"
                await asyncio.sleep(0.1)
        finally:
            holder.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _answers(port: int) -> bool:
    try:
        return (await get(f"http://127.0.0.1:{port}/"))[0] == 200
    except OSError:
        return False


async def _store_dead_letters(settings: Settings) -> None:
    """Two dead letters in the buffer file, as a previous run of the agent left them."""
    box = await Outbox.open(settings.buffer_path, settings.buffer, settings.gateway_id, Metrics())
    box.start()
    try:
        await box.dead_letter(
            mqtt_topic="x/y", payload=b"p", qos=1, retain=False, reason="unroutable", detail="d"
        )
        await box.dead_letter(
            mqtt_topic="edge/d/up/e", payload=b"p" * 9, qos=1, retain=False, reason="oversize", detail="d"
        )
    finally:
        await box.close()


def _live_status_until_q(config: Path) -> tuple[int | None, bytes]:
    """`iggy-edge status` in a terminal: wait for its view, press q; its exit
    code (None when it did not end) and what it drew."""
    main, side = pty.openpty()
    proc = subprocess.Popen(
        [AGENT, "status", "-c", str(config), "-i", "0.2"], stdin=side, stdout=side, stderr=side
    )
    os.close(side)
    seen = b""
    try:
        deadline = time.monotonic() + 20
        while b"dead letters" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.5)
            if ready:
                seen += os.read(main, 4096)
        os.write(main, b"q")
        try:
            return proc.wait(timeout=10), seen
        except subprocess.TimeoutExpired:
            return None, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)


async def test_status_shows_the_stored_dead_letters_after_a_restart_and_q_quits(
    tmp_path: Path, broker: Broker
) -> None:
    port = free_port()
    config = _config_file(tmp_path, broker, port)
    settings = _settings(tmp_path, broker, port)
    await _store_dead_letters(settings)
    runner = CliRunner()
    async with running_agent(settings, MemoryIggy().uplink(), components=(http_endpoint,)):
        result = await asyncio.to_thread(runner.invoke, app, ["status", "-c", str(config), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert not any(doc["store"]["dead_letters"].values())  # none since this start
        assert doc["stored"]["dead_letters"] == 2
        assert doc["stored"]["dead_letters_by_reason"] == {"oversize": 1, "unroutable": 1}
        once = await asyncio.to_thread(runner.invoke, app, ["status", "-c", str(config), "--once"])
        assert "stored 2 (oversize 1, unroutable 1); since start none" in once.stdout, once.stdout

        code, drawn = await asyncio.to_thread(_live_status_until_q, config)
        assert b"dead letters" in drawn, drawn
        assert code == 0, drawn
