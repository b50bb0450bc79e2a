"""`iggy-edge demo`: the whole pipeline on one machine, with live figures.

Starts a private Mosquitto on a free port (unless a broker is configured),
a few simulated sensors, and the agent.  With IGGY_ADDRESS (and
IGGY_USERNAME / IGGY_PASSWORD) set it forwards to that Iggy server; without,
it says so and the backlog grows in the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from ..config import ConfigError, Settings, parse_config
from ..logs import setup_logging
from ..metrics import DEAD_LETTER_REASONS
from ..runtime import build_agent
from ..simulate import SimulatedSensor
from .common import fail
from .run import run_agent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_mosquitto(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if binary is None:
        raise fail(
            "no MQTT broker configured and mosquitto is not installed "
            "(sudo apt-get install mosquitto, or set IGGY_EDGE_MQTT_HOST)"
        )
    port = _free_port()
    conf = workdir / "mosquitto.conf"
    # As root, mosquitto would drop to its own user, which cannot write our temp dir.
    run_as = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(
        f"{run_as}listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
        f"persistence_location {workdir}/\nmax_queued_messages 1000000\nmax_inflight_messages 0\n"
        f"log_dest file {workdir}/mosquitto.log\n"
    )
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return proc, port
        time.sleep(0.05)
    proc.kill()
    raise fail(f"mosquitto did not start (see {workdir}/mosquitto.log)")


def demo(
    sensors: Annotated[int, typer.Option(min=1, max=1000, help="Simulated sensors.")] = 5,
    rate: Annotated[float, typer.Option(min=0.1, max=1000, help="Readings per second per sensor.")] = 2.0,
    duration: Annotated[float, typer.Option(help="Stop after this many seconds (0 = until Ctrl-C).")] = 0.0,
    state_dir: Annotated[
        Path | None, typer.Option(help="Where the demo keeps its buffer (default: a fresh temp dir).")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the agent's log.")] = False,
) -> None:
    """Run a local broker, simulated sensors and the agent, and show live figures."""
    setup_logging("INFO" if verbose else "WARNING")
    workdir = state_dir or Path(tempfile.mkdtemp(prefix="iggy-edge-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    broker: subprocess.Popen[bytes] | None = None
    host = os.environ.get("IGGY_EDGE_MQTT_HOST")
    port = int(os.environ.get("IGGY_EDGE_MQTT_PORT", "1883"))
    if host is None:
        broker, port = _start_mosquitto(workdir)
        host = "127.0.0.1"
        typer.echo(f"broker    started a private Mosquitto on {host}:{port}")
    else:
        typer.echo(f"broker    using {host}:{port}")
    raw = {
        "gateway_id": "demo-gw",
        "state_dir": str(workdir),
        "mqtt": {"host": host, "port": port},
        "metrics": {"listen": f"127.0.0.1:{_free_port()}"},
    }
    env = dict(os.environ)
    env.pop("IGGY_EDGE_MQTT_HOST", None)
    env.pop("IGGY_EDGE_MQTT_PORT", None)
    try:
        settings = parse_config(raw, source="demo", env=env)
    except ConfigError as e:
        raise fail(str(e), 2) from None
    if settings.iggy.kind == "iggy":
        typer.echo(f"uplink    Iggy at {settings.iggy.address} as {settings.iggy.username}")
    else:
        typer.secho(
            "uplink    none configured (set IGGY_ADDRESS, IGGY_USERNAME, IGGY_PASSWORD to forward to Iggy):\n"
            "          records stay in the outbox; watch the backlog grow",
            fg=typer.colors.YELLOW,
        )
    typer.echo(f"buffer    {settings.buffer_path}")
    typer.echo(f"sensors   {sensors} x {rate}/s on edge/<device>/up/env (Ctrl-C to stop)\n")
    try:
        asyncio.run(_demo(settings, host, port, sensors, rate, duration))
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(10)


async def _demo(settings: Settings, host: str, port: int, n: int, rate: float, duration: float) -> None:
    agent = build_agent(settings)
    agent_task = asyncio.create_task(run_agent(agent))
    if not await agent.wait_up(30):
        agent.stop()
        await agent_task
        raise fail(f"the agent has no MQTT session with {host}:{port} after 30 s")
    stop = asyncio.Event()
    fleet = [SimulatedSensor(f"sensor-{i:02d}", rate_hz=rate) for i in range(n)]
    sims = [asyncio.create_task(s.run(host, port, stop)) for s in fleet]
    m = agent.metrics
    started = time.monotonic()
    typer.echo(
        f"{'time':>6} {'published':>10} {'ingested':>9} {'buffered':>9} {'forwarded':>10} {'dead':>5}  uplink"
    )
    try:
        while not agent_task.done():
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - started
            ingested = sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012")
            dead = sum(m.value("iggy_edge_store_dead_letters_total", reason=r) for r in DEAD_LETTER_REASONS)
            typer.echo(
                f"{elapsed:5.0f}s {sum(s.sent for s in fleet):>10} {ingested:>9.0f} "
                f"{m.value('iggy_edge_store_backlog_records'):>9.0f} "
                f"{m.value('iggy_edge_forward_records_total'):>10.0f} {dead:>5.0f}  {agent.health().uplink}"
            )
            if duration and elapsed >= duration:
                break
    finally:
        stop.set()
        await asyncio.gather(*sims, return_exceptions=True)
        agent.stop()
        await agent_task
