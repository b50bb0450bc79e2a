"""What an idle agent's Iggy side costs the machine: CPU and threads.

Builds ``--gateways`` gateways in this one process the way the agent and
bench/_fleet_gateways.py build them (each its own buffer file with `Outbox`
and `Inbox`, the real `Forwarder` and `ReturnPoll`), against `MemoryIggy`
so that no server's answers are in the figure: what is measured is the
agent's own work at rest (the forwarder waiting for records, the return
poll's rounds, aiosqlite's threads).  After every gateway has forwarded its
one record and ``--settle`` seconds have passed, the process's CPU over
``--window`` seconds, per gateway, and its thread count.

    .venv/bin/python bench/idle_bench.py --gateways 50 --window 20
    .venv/bin/python bench/idle_bench.py --gateways 50 --profile /tmp/idle.prof
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import emit, emit_machine
from iggy_edge.config import parse_config
from iggy_edge.downlink.commands import return_topic
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.poll import ReturnPoll
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.memory import MemoryIggy

BENCH = "idle"


class Idle:
    """One gateway's Iggy side on a MemoryIggy."""

    def __init__(self, index: int, workdir: Path, iggy: MemoryIggy) -> None:
        self.id = f"gw-{index:05d}"
        self.settings = parse_config(
            {
                "gateway_id": self.id,
                "state_dir": str(workdir / self.id),
                "iggy": {"kind": "memory"},
                "buffer": {"synchronous": "normal"},
                "metrics": {"enabled": False},
            },
            env={},
        )
        rt = return_topic(self.settings)
        iggy.create_topic(rt.stream, rt.topic, 1)
        self.iggy = iggy
        self.metrics = Metrics()
        self.tasks: list[asyncio.Task[None]] = []
        self.closers: list[Any] = []

    async def start(self) -> None:
        box = await Outbox.open(self.settings.buffer_path, self.settings.buffer, self.id, self.metrics)
        box.start()
        inbox = await Inbox.open(self.settings.buffer_path, self.settings)
        self.closers = [inbox, box]
        route = Route("edge", "telemetry", f"{self.id}-dev0")
        await box.submit(
            Incoming(route, f"edge/{route.key}/up/env", 1, False, time.time_ns() // 1000, b"{}", 1)
        )
        fwd = Forwarder(box, self.iggy.uplink(), self.settings.forward, self.metrics)
        poll = ReturnPoll(self.settings, self.iggy.command_source(), inbox, box, self.metrics)
        self.tasks = [asyncio.create_task(fwd.run()), asyncio.create_task(poll.run())]

    @property
    def forwarded(self) -> bool:
        return self.metrics.value("iggy_edge_forward_records_total") > 0

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.closers:
            await c.close()


async def measure(args: argparse.Namespace, workdir: Path) -> None:
    iggy = MemoryIggy()
    iggy.create_topic("edge", "telemetry", 3)
    gateways = [Idle(i, workdir, iggy) for i in range(args.gateways)]
    for g in gateways:
        await g.start()
    deadline = time.monotonic() + 60
    while not all(g.forwarded for g in gateways):
        if time.monotonic() > deadline:
            raise SystemExit("not every gateway forwarded its record within 60 s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(args.settle)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.sleep(args.window)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    threads = threading.active_count()
    for g in gateways:
        await g.close()
    n = len(gateways)
    emit(BENCH, "gateways", n)
    emit(BENCH, "cpu_at_rest", round(cpu / wall, 4), "cores", window_s=round(wall, 1))
    emit(BENCH, "cpu_at_rest_per_gateway", round(1000 * cpu / wall / n, 3), "ms/s")
    emit(BENCH, "threads", threads, "", per_gateway=round((threads - 1) / n, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateways", type=int, default=50)
    p.add_argument("--settle", type=float, default=3.0, help="seconds at rest before the window")
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--profile", help="write cProfile stats of the window here")
    p.add_argument("--quick", action="store_true", help="5 gateways, a 2 s window (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.gateways, args.settle, args.window = 5, 1.0, 2.0
    emit_machine(BENCH)
    with tempfile.TemporaryDirectory(prefix="idle-bench-") as tmp:
        asyncio.run(measure(args, Path(tmp)))


if __name__ == "__main__":
    main()
