"""The demo's run: the agent, simulated sensors and (with a single Iggy
node) a `TcpRelay` the agent reaches Iggy through, so the demo can cut the
uplink and heal it (on the plan or by the ``c`` key) while a row of figures
is printed every second.  `iggy-edge demo` (cli/demo.py) starts the private
services, builds the settings and hands over here; `echo` is its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .cloud.provision import create_return_topic
from .config import Settings
from .local_services import IggyView, PrivateIggy, ServiceError
from .logs import install_loop_exception_handler
from .metrics import DEAD_LETTER_REASONS, DROP_REASONS
from .records import Route
from .relay import TcpRelay
from .routing import Router
from .runtime import Agent, build_agent
from .simulate import SimulatedSensor
from .timeouts import wait_for
from .uplink.protocol import UplinkError


@dataclass(frozen=True)
class Plan:
    sensors: int
    rate: float
    duration: float
    cut_after: float
    cut_for: float


class UplinkCut:
    """The demo's hand on the link to Iggy: a `TcpRelay` the agent reaches
    Iggy through (a single node only), cut and healed on the plan or by key."""

    def __init__(self, relay: TcpRelay | None, echo: Callable[[str], None]) -> None:
        self.relay = relay
        self.echo = echo
        self.cuts = 0

    async def toggle(self) -> None:
        relay = self.relay
        if relay is None:
            self.echo("          (no uplink to cut: the demo forwards to no single Iggy node)")
        elif relay.is_cut:
            await relay.restore()
            self.echo("          -- uplink healed: watch the buffer drain --")
        else:
            await relay.cut()
            self.cuts += 1
            self.echo("          -- uplink cut: the agent keeps buffering --")

    async def follow(self, plan: Plan) -> None:
        if not plan.cut_after:
            return
        await asyncio.sleep(plan.cut_after)
        await self.toggle()
        await asyncio.sleep(plan.cut_for)
        if self.relay is not None and self.relay.is_cut:
            await self.toggle()


@contextlib.contextmanager
def keys(loop: asyncio.AbstractEventLoop, on_key: Callable[[str], None]) -> Iterator[None]:
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


async def run_demo(
    settings: Settings,
    host: str,
    port: int,
    plan: Plan,
    iggy: PrivateIggy | None,
    echo: Callable[[str], None],
) -> bool:
    """Run the demo until its duration, SIGTERM or Ctrl-C; True after Ctrl-C.
    Raises ServiceError when the agent gets no MQTT session."""
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
    uplink = UplinkCut(relay, echo)
    if iggy is not None and settings.downlink.enabled:  # the private server: the demo is the cloud side
        with contextlib.suppress(UplinkError):
            await create_return_topic(settings)
    agent = build_agent(settings)
    agent_task = asyncio.create_task(agent.run())
    background: list[asyncio.Task[None]] = []
    view: IggyView | None = None
    try:
        if not await agent.wait_up(30):
            raise ServiceError(f"the agent has no MQTT session with {host}:{port} after 30 s")
        fleet = [
            SimulatedSensor(f"sensor-{i:02d}", rate_hz=plan.rate, topics=settings.topics)
            for i in range(plan.sensors)
        ]
        background += [asyncio.create_task(s.run(host, port, stop)) for s in fleet]
        # Where the sensors' readings go, as ingest routes them.
        route = Router(settings.routes, settings.buffer.max_payload_bytes).route(fleet[0].topic, 1)
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
        with keys(loop, on_key):
            if sys.stdin.isatty():
                echo("keys      c cuts / heals the uplink, q quits")
            echo("")
            await _table(agent, fleet, view, uplink, plan, stop, agent_task, pressed, echo)
        _summary(agent, fleet, view, uplink, echo)
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
    uplink: UplinkCut,
    plan: Plan,
    stop: asyncio.Event,
    agent_task: asyncio.Task[None],
    pressed: asyncio.Queue[str],
    echo: Callable[[str], None],
) -> None:
    """A row a second, each sampled at once when it is printed."""
    m = agent.metrics
    started = time.monotonic()
    echo(
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
        echo(
            f"{elapsed:5.0f}s {sum(s.sent for s in fleet):>10} {ingested:>9.0f} "
            f"{m.value('iggy_edge_store_backlog_records'):>9.0f} "
            f"{m.value('iggy_edge_forward_records_total'):>10.0f} {dead:>5.0f} {held:>8}  "
            f"{agent.health().uplink}{cut}"
        )
        if plan.duration and elapsed >= plan.duration:
            break


def _summary(
    agent: Agent,
    fleet: list[SimulatedSensor],
    view: IggyView | None,
    uplink: UplinkCut,
    echo: Callable[[str], None],
) -> None:
    m = agent.metrics
    ingested = sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012")
    dead = sum(m.value("iggy_edge_store_dead_letters_total", reason=r) for r in DEAD_LETTER_REASONS)
    dropped = sum(m.value("iggy_edge_store_dropped_records_total", reason=r) for r in DROP_REASONS)
    echo(
        f"\nsummary   published {sum(s.sent for s in fleet)}, ingested {ingested:.0f}, "
        f"forwarded {m.value('iggy_edge_forward_records_total'):.0f}"
        + ("" if view is None else f" (read back from Iggy {view.held})")
        + f", still buffered {m.value('iggy_edge_store_backlog_records'):.0f}"
        + f", dead letters {dead:.0f}, dropped {dropped:.0f}"
        + (f"; uplink cut {uplink.cuts} time(s)" if uplink.cuts else "")
    )
