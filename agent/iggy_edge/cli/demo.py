"""`iggy-edge demo`: the whole pipeline on one machine, with live figures.

Starts a private Mosquitto on a free port (unless a broker is configured),
a few simulated sensors, and the agent.  With IGGY_ADDRESS (and
IGGY_USERNAME / IGGY_PASSWORD) set it forwards to that Iggy server.  Without
them, when `iggy-server` is on PATH, it starts a private one (`PrivateIggy`: a
temporary data directory, a free loopback port, root credentials made up for
the run, stopped and removed on exit, Ctrl-C included) and the live table
shows what that server holds; otherwise it says how to get forwarding and
the backlog grows in the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from pydantic import SecretStr

from ..config import ConfigError, IggySettings, Settings, parse_config
from ..logs import setup_logging
from ..metrics import DEAD_LETTER_REASONS
from ..records import Route
from ..routing import Router
from ..runtime import build_agent
from ..simulate import SimulatedSensor
from ..uplink.iggy import IggyCommandSource, IggyProbe
from ..uplink.protocol import UplinkError
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


NO_IGGY_HINT = (
    "uplink    none configured: records stay in the outbox; watch the backlog grow.\n"
    "          To forward, set IGGY_ADDRESS, IGGY_USERNAME, IGGY_PASSWORD, or put iggy-server 0.9.x\n"
    "          on PATH and the demo starts a private one (build it from apache/iggy, tag\n"
    "          server-0.9.0-edge.5: cargo build --release -p server --bin iggy-server)"
)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the demo dies, even by SIGKILL
    (Linux prctl PR_SET_PDEATHSIG), so no server outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)


class PrivateIggy:
    """An `iggy-server` for the demo alone: a temporary data directory, a free
    loopback port, TCP only, one shard, the smallest memory pool, and root
    credentials made up for this run.  It runs in a session of its own, so a
    Ctrl-C reaches the demo, which stops it (`stop`) and removes its data."""

    USERNAME = "iggy"

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.datadir = Path(tempfile.mkdtemp(prefix="iggy-edge-demo-iggy-"))
        self.address = f"127.0.0.1:{_free_port()}"
        self.password = secrets.token_urlsafe(18)
        self.proc: subprocess.Popen[bytes] | None = None

    def settings(self) -> IggySettings:
        return IggySettings(
            kind="iggy", address=self.address, username=self.USERNAME, password=SecretStr(self.password)
        )

    def start(self, timeout: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IGGY_")}
        env.update(
            {
                "IGGY_TCP_ADDRESS": self.address,
                "IGGY_HTTP_ENABLED": "false",
                "IGGY_QUIC_ENABLED": "false",
                "IGGY_WEBSOCKET_ENABLED": "false",
                "IGGY_SYSTEM_PATH": str(self.datadir / "data"),
                "IGGY_ROOT_USERNAME": self.USERNAME,
                "IGGY_ROOT_PASSWORD": self.password,
                "IGGY_SYSTEM_SHARDING_CPU_ALLOCATION": "1",
                "IGGY_SYSTEM_SHARDING_PIN_CORES": "false",
                "IGGY_TELEMETRY_ENABLED": "false",
                "IGGY_SYSTEM_MEMORY_POOL_SIZE": "512 MiB",  # the minimum; the default is 4 GiB
            }
        )
        with (self.datadir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary],
                cwd=self.datadir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads yet, and it is one prctl
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise fail(f"iggy-server exited with {self.proc.returncode} (see {self.datadir}/server.log)")
            if asyncio.run(self._logs_in()):
                return
            if time.monotonic() > deadline:
                raise fail(f"iggy-server does not accept a login after {timeout:.0f} s")
            time.sleep(0.2)

    async def _logs_in(self) -> bool:
        try:
            async with IggyProbe(self.settings(), timeout_s=2.0):
                return True
        except UplinkError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.datadir, ignore_errors=True)


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
    iggy: PrivateIggy | None = None
    try:
        try:
            settings = parse_config(raw, source="demo", env=env)
            binary = shutil.which("iggy-server")
            if settings.iggy.kind != "iggy" and binary is not None:
                iggy = PrivateIggy(binary)
                typer.echo(f"iggy      starting a private iggy-server ({binary}) on {iggy.address} ...")
                iggy.start()
                env.update(
                    {
                        "IGGY_ADDRESS": iggy.address,
                        "IGGY_USERNAME": iggy.USERNAME,
                        "IGGY_PASSWORD": iggy.password,
                    }
                )
                settings = parse_config(raw, source="demo", env=env)
        except ConfigError as e:
            raise fail(str(e), 2) from None
        if iggy is not None:
            typer.echo(
                f"uplink    the private Iggy at {iggy.address} (data in {iggy.datadir}, removed on exit)"
            )
        elif settings.iggy.kind == "iggy":
            typer.echo(f"uplink    Iggy at {settings.iggy.address} as {settings.iggy.username}")
        else:
            typer.secho(NO_IGGY_HINT, fg=typer.colors.YELLOW)
        _show(settings, host, port, sensors, rate, duration, iggy)
    finally:
        if iggy is not None:
            iggy.stop()
        if broker is not None:
            broker.terminate()
            broker.wait(10)


def _show(
    settings: Settings,
    host: str,
    port: int,
    sensors: int,
    rate: float,
    duration: float,
    iggy: PrivateIggy | None,
) -> None:
    typer.echo(f"buffer    {settings.buffer_path}")
    typer.echo(f"sensors   {sensors} x {rate}/s on edge/<device>/up/env (Ctrl-C to stop)\n")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_demo(settings, host, port, sensors, rate, duration, iggy))


class IggyView:
    """What the private server holds in one topic, read back from it: every
    partition polled from where the last look ended (its own consumer name,
    nothing stored on the server)."""

    def __init__(self, settings: IggySettings, stream: str, topic: str) -> None:
        self._source = IggyCommandSource(settings, "demo", "iggy-edge-demo-view")
        self._stream, self._topic = stream, topic
        self._next = [0] * settings.partitions
        self.held = 0

    async def look(self) -> str:
        try:
            for p, start in enumerate(self._next):
                got = await self._source.poll(self._stream, self._topic, p, start, 10_000)
                if got:
                    self._next[p] = got[-1].offset + 1
                    self.held += len(got)
        except UplinkError:
            return "?"
        return str(self.held)

    async def close(self) -> None:
        await self._source.close()


async def _demo(
    settings: Settings, host: str, port: int, n: int, rate: float, duration: float, iggy: PrivateIggy | None
) -> None:
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
    # Where the sensors' readings go (edge/<device>/up/env), as ingest routes them.
    route = Router(settings.routes, settings.buffer.max_payload_bytes).route("edge/sensor-00/up/env", 1)
    view = (
        IggyView(iggy.settings(), route.stream, route.topic)
        if iggy is not None and isinstance(route, Route)
        else None
    )
    started = time.monotonic()
    typer.echo(
        f"{'time':>6} {'published':>10} {'ingested':>9} {'buffered':>9} {'forwarded':>10} {'dead':>5} "
        f"{'in_iggy':>8}  uplink"
    )
    try:
        while not agent_task.done():
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - started
            ingested = sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012")
            dead = sum(m.value("iggy_edge_store_dead_letters_total", reason=r) for r in DEAD_LETTER_REASONS)
            held = "-" if view is None else await view.look()
            typer.echo(
                f"{elapsed:5.0f}s {sum(s.sent for s in fleet):>10} {ingested:>9.0f} "
                f"{m.value('iggy_edge_store_backlog_records'):>9.0f} "
                f"{m.value('iggy_edge_forward_records_total'):>10.0f} {dead:>5.0f} {held:>8}  "
                f"{agent.health().uplink}"
            )
            if duration and elapsed >= duration:
                break
    finally:
        stop.set()
        await asyncio.gather(*sims, return_exceptions=True)
        agent.stop()
        await agent_task
        if view is not None:
            await view.close()
