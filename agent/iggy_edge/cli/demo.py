"""`iggy-edge demo`: the whole pipeline on one machine, with live figures.

Starts a private Mosquitto on a free port (unless a broker is configured),
a few simulated sensors, and the agent.  With IGGY_ADDRESS (and
IGGY_USERNAME / IGGY_PASSWORD) set it forwards to that Iggy server.  Without
them, when `iggy-server` is on PATH, it starts a private one (`PrivateIggy`: a
temporary data directory, a free loopback port, root credentials made up for
the run, stopped and removed on exit, Ctrl-C included) and the live table
shows what that server holds; otherwise it says how to get forwarding and
the backlog grows in the outbox.

The agent reaches a single Iggy node through a `TcpRelay`, so the demo can
cut the uplink and heal it (`--cut-uplink-after S` for `--cut-for` seconds,
or the ``c`` key): the buffer fills and drains while the table goes on.  A
row is printed every second whatever the uplink does (what the private
server holds is read back in the background, ``?`` while that read is
stale).  Ctrl-C stops everything, prints the summary and exits 130; the
temporary directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import time
import tty
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from ..config import ConfigError, Settings, parse_config
from ..httpd import local_url
from ..local_services import IggyView, PrivateIggy, ServiceError, free_port, start_mosquitto
from ..logs import install_loop_exception_handler, setup_logging
from ..metrics import DEAD_LETTER_REASONS, DROP_REASONS
from ..records import Route
from ..relay import TcpRelay
from ..routing import Router
from ..runtime import Agent, build_agent
from ..simulate import SimulatedSensor
from ..timeouts import wait_for
from .common import fail

NO_IGGY_HINT = (
    "uplink    none configured: records stay in the outbox; watch the backlog grow.\n"
    "          To forward, set IGGY_ADDRESS, IGGY_USERNAME, IGGY_PASSWORD, or\n"
    "          put iggy-server 0.9.x on PATH and the demo starts a private one\n"
    "          (build it from apache/iggy, tag server-0.9.0-edge.5:\n"
    "          cargo build --release -p server --bin iggy-server)"
)


def demo(
    sensors: Annotated[int, typer.Option(min=1, max=1000, help="Simulated sensors.")] = 5,
    rate: Annotated[float, typer.Option(min=0.1, max=1000, help="Readings per second per sensor.")] = 2.0,
    duration: Annotated[float, typer.Option(help="Stop after this many seconds (0 = until Ctrl-C).")] = 0.0,
    cut_uplink_after: Annotated[
        float,
        typer.Option(
            help="Cut the link to Iggy after this many seconds and heal it --cut-for seconds later,"
            " to watch the buffer fill and drain (0 = never; the c key toggles it too)."
        ),
    ] = 0.0,
    cut_for: Annotated[float, typer.Option(min=1, help="How long --cut-uplink-after cuts the link.")] = 15.0,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where the demo keeps its buffer (default: a fresh temp dir, removed on exit)."),
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
    env = dict(os.environ)
    env.pop("IGGY_EDGE_MQTT_HOST", None)
    env.pop("IGGY_EDGE_MQTT_PORT", None)
    iggy: PrivateIggy | None = None
    interrupted = False
    try:
        if host is None:
            try:
                broker, port = start_mosquitto(workdir)
            except ServiceError as e:
                raise fail(str(e)) from None
            host = "127.0.0.1"
            typer.echo(f"broker    started a private Mosquitto on {host}:{port}")
        else:
            typer.echo(f"broker    using {host}:{port}")
        raw = {
            "gateway_id": "demo-gw",
            "state_dir": str(workdir),
            "mqtt": {"host": host, "port": port},
            "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        }
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
        except ServiceError as e:
            raise fail(str(e)) from None
        if iggy is not None:
            typer.echo(
                f"uplink    the private Iggy at {iggy.address} (data in {iggy.datadir}, removed on exit)"
            )
        elif settings.iggy.kind == "iggy":
            typer.echo(f"uplink    Iggy at {settings.iggy.address} as {settings.iggy.username}")
        else:
            typer.secho(NO_IGGY_HINT, fg=typer.colors.YELLOW)
        typer.echo(f"buffer    {settings.buffer_path}")
        typer.echo(f"dashboard {local_url(settings.metrics.listen)}/  (open it in a browser)")
        typer.echo(f"sensors   {sensors} x {rate}/s on edge/<device>/up/env (Ctrl-C to stop)")
        plan = _Plan(sensors, rate, duration, cut_uplink_after, cut_for)
        try:
            interrupted = asyncio.run(_demo(settings, host, port, plan, iggy))
        except KeyboardInterrupt:  # Ctrl-C before the demo's own handler was installed
            interrupted = True
    finally:
        if iggy is not None:
            iggy.stop()
        if broker is not None:
            broker.terminate()
            broker.wait(10)
        if state_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if interrupted:
        raise typer.Exit(130)  # what a shell reports for a command ended by Ctrl-C


@dataclass(frozen=True)
class _Plan:
    sensors: int
    rate: float
    duration: float
    cut_after: float
    cut_for: float


class _Uplink:
    """The demo's hand on the link to Iggy: a `TcpRelay` the agent reaches
    Iggy through (a single node only), cut and healed on the plan or by key."""

    def __init__(self, relay: TcpRelay | None) -> None:
        self.relay = relay
        self.cuts = 0

    async def toggle(self) -> None:
        relay = self.relay
        if relay is None:
            typer.echo("          (no uplink to cut: the demo forwards to no single Iggy node)")
        elif relay.is_cut:
            await relay.restore()
            typer.echo("          -- uplink healed: watch the buffer drain --")
        else:
            await relay.cut()
            self.cuts += 1
            typer.echo("          -- uplink cut: the agent keeps buffering --")

    async def follow(self, plan: _Plan) -> None:
        if not plan.cut_after:
            return
        await asyncio.sleep(plan.cut_after)
        await self.toggle()
        await asyncio.sleep(plan.cut_for)
        if self.relay is not None and self.relay.is_cut:
            await self.toggle()


@contextlib.contextmanager
def _keys(loop: asyncio.AbstractEventLoop, on_key: Callable[[str], None]) -> Iterator[None]:
    """Single keys from the terminal (cbreak mode, restored on exit); nothing
    when stdin is not a terminal."""
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    loop.add_reader(fd, lambda: on_key(os.read(fd, 1).decode(errors="replace")))
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _demo(settings: Settings, host: str, port: int, plan: _Plan, iggy: PrivateIggy | None) -> bool:
    """Run the demo until its duration, SIGTERM or Ctrl-C; True after Ctrl-C."""
    loop = asyncio.get_running_loop()
    install_loop_exception_handler(loop)
    stop = asyncio.Event()
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        stop.set()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    relay = None
    if settings.iggy.kind == "iggy" and not settings.iggy.addresses:
        target_host, _, target_port = settings.iggy.address.rpartition(":")
        relay = await TcpRelay(target_host, int(target_port)).start()
        relay_iggy = settings.iggy.model_copy(update={"address": relay.address})
        settings = settings.model_copy(update={"iggy": relay_iggy})
    uplink = _Uplink(relay)
    agent = build_agent(settings)
    agent_task = asyncio.create_task(agent.run())
    background: list[asyncio.Task[None]] = []
    view: IggyView | None = None
    try:
        if not await agent.wait_up(30):
            raise fail(f"the agent has no MQTT session with {host}:{port} after 30 s")
        fleet = [SimulatedSensor(f"sensor-{i:02d}", rate_hz=plan.rate) for i in range(plan.sensors)]
        background += [asyncio.create_task(s.run(host, port, stop)) for s in fleet]
        # Where the sensors' readings go (edge/<device>/up/env), as ingest routes them.
        route = Router(settings.routes, settings.buffer.max_payload_bytes).route("edge/sensor-00/up/env", 1)
        if iggy is not None and isinstance(route, Route):
            view = IggyView(iggy.settings(), route.stream, route.topic)
            background.append(asyncio.create_task(view.run()))
        background.append(asyncio.create_task(uplink.follow(plan)))
        pressed: asyncio.Queue[str] = asyncio.Queue(16)

        def on_key(key: str) -> None:
            if not pressed.full():
                pressed.put_nowait(key)

        async def quit_on_stop() -> None:  # a stop ends the wait for the next row at once
            await stop.wait()
            on_key("q")

        background.append(asyncio.create_task(quit_on_stop()))
        with _keys(loop, on_key):
            if sys.stdin.isatty():
                typer.echo("keys      c cuts / heals the uplink, q quits")
            typer.echo("")
            await _table(agent, fleet, view, uplink, plan, stop, agent_task, pressed)
        _summary(agent, fleet, view, uplink)
    finally:
        stop.set()
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        agent.stop()
        await agent_task
        if view is not None:
            await view.close()
        if relay is not None:
            await relay.stop()
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)
    return interrupted


async def _table(
    agent: Agent,
    fleet: list[SimulatedSensor],
    view: IggyView | None,
    uplink: _Uplink,
    plan: _Plan,
    stop: asyncio.Event,
    agent_task: asyncio.Task[None],
    pressed: asyncio.Queue[str],
) -> None:
    """A row a second, each sampled at once when it is printed."""
    m = agent.metrics
    started = time.monotonic()
    typer.echo(
        f"{'time':>6} {'published':>10} {'ingested':>9} {'buffered':>9} {'forwarded':>10} {'dead':>5} "
        f"{'in_iggy':>8}  uplink"
    )
    tick = 0
    while not stop.is_set() and not agent_task.done():
        tick += 1
        with contextlib.suppress(TimeoutError):
            key = await wait_for(pressed.get(), max(0.0, started + tick - time.monotonic()))
            if key in "qQ":
                break
            if key in "cC":
                await uplink.toggle()
            tick -= 1  # a key came before the row was due: wait out the same row
            continue
        elapsed = time.monotonic() - started
        ingested = sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012")
        dead = sum(m.value("iggy_edge_store_dead_letters_total", reason=r) for r in DEAD_LETTER_REASONS)
        held = "-" if view is None else view.shown()
        cut = " (cut by the demo)" if uplink.relay is not None and uplink.relay.is_cut else ""
        typer.echo(
            f"{elapsed:5.0f}s {sum(s.sent for s in fleet):>10} {ingested:>9.0f} "
            f"{m.value('iggy_edge_store_backlog_records'):>9.0f} "
            f"{m.value('iggy_edge_forward_records_total'):>10.0f} {dead:>5.0f} {held:>8}  "
            f"{agent.health().uplink}{cut}"
        )
        if plan.duration and elapsed >= plan.duration:
            break


def _summary(agent: Agent, fleet: list[SimulatedSensor], view: IggyView | None, uplink: _Uplink) -> None:
    m = agent.metrics
    ingested = sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012")
    dead = sum(m.value("iggy_edge_store_dead_letters_total", reason=r) for r in DEAD_LETTER_REASONS)
    dropped = sum(m.value("iggy_edge_store_dropped_records_total", reason=r) for r in DROP_REASONS)
    typer.echo(
        f"\nsummary   published {sum(s.sent for s in fleet)}, ingested {ingested:.0f}, "
        f"forwarded {m.value('iggy_edge_forward_records_total'):.0f}"
        + ("" if view is None else f" (read back from Iggy {view.held})")
        + f", still buffered {m.value('iggy_edge_store_backlog_records'):.0f}"
        + f", dead letters {dead:.0f}, dropped {dropped:.0f}"
        + (f"; uplink cut {uplink.cuts} time(s)" if uplink.cuts else "")
    )
