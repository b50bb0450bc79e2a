"""One process of simulated gateways for bench/fleet_bench.py.

Each gateway is what the agent runs on the Iggy side, built the way the
agent builds it: its own buffer database (a SQLite file: `Outbox` and the
return path's `Inbox` on it), the real `Forwarder`, and the uplink and
command source from `make_uplink_and_source` (one shared connection;
``--separate`` takes the older `make_uplink` + `make_command_source`, one
connection each) driven by the real `ReturnPoll`.  No MQTT side: the
return path's deliverer and the ingest are not what a gateway costs the
Iggy server.

Requests are counted at the SDK boundary: `IggyClient` is replaced in
connection.py by `CountingClient`, which counts every call by method
before handing it to a real client; the SDK's own heartbeats (a Rust task,
invisible here) are counted from the connected clients' intervals.  The
orchestrator also counts what the servers' sockets received (the kernel's
per-socket counters), which includes the heartbeats.

Control, one JSON object per line: the orchestrator writes commands on
stdin (``go``, ``counts``, ``stored``, ``stop``), this process answers on
stdout (``built``, ``ready``, ``counts``, ``stored``, ``stopped``).  Logs
go to stderr, warnings and above only.

    python bench/_fleet_gateways.py '<json config>'
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import json
import logging
import os
import signal
import sys
import time
import weakref
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))

import apache_iggy
from iggy_edge.config import Settings, parse_config
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.poll import ReturnPoll
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink import factory
from iggy_edge.uplink.iggy import connection

CALLS: Counter[str] = Counter()
LIVE: weakref.WeakSet[CountingClient] = weakref.WeakSet()
# The gateway whose task makes a client (set before its tasks are created:
# they copy the context), and the failures of its calls before it was ready.
GATEWAY: contextvars.ContextVar[Gateway | None] = contextvars.ContextVar("gateway", default=None)


class CountingClient:
    """An `apache_iggy.IggyClient` that counts the calls made on it."""

    def __init__(self, config: apache_iggy.TcpConfig) -> None:
        self._inner = apache_iggy.IggyClient(config)
        interval = config.heartbeat_interval
        self.heartbeat_s = interval.total_seconds() if isinstance(interval, timedelta) else 5.0
        self.connected_at: float | None = None
        self.gateway = GATEWAY.get()
        LIVE.add(self)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            CALLS[name] += 1
            if name == "connect":
                self.connected_at = time.monotonic()
            return self._watch(name, attr(*args, **kwargs))

        return call

    async def _watch(self, name: str, awaitable: Any) -> Any:
        """The call's result; a failure is noted on the gateway while it is
        not ready yet: cancelled (the agent's timeout ran out) or the SDK's error text."""
        try:
            return await awaitable
        except asyncio.CancelledError:
            self._note(f"{name}: timed out")
            raise
        except Exception as e:
            self._note(f"{name}: {str(e)[:60]}")
            raise

    def _note(self, what: str) -> None:
        if self.gateway is not None and self.gateway.ready_at is None:
            self.gateway.failures[what] += 1


def heartbeats_per_s() -> tuple[int, float]:
    """(connected clients alive, the heartbeats per second they send)."""
    live = [c for c in LIVE if c.connected_at is not None]
    return len(live), sum(1 / c.heartbeat_s for c in live)


def error_count(metrics: Metrics) -> int:
    total = 0.0
    for family in metrics.registry.collect():
        if family.name in ("iggy_edge_forward_errors", "iggy_edge_downlink_errors"):
            total += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return int(total)


class Gateway:
    def __init__(self, index: int, workdir: Path, cfg: dict[str, Any]) -> None:
        self.id = f"gw-{index:05d}"
        state = workdir / self.id
        state.mkdir(parents=True, exist_ok=True)
        iggy: dict[str, Any] = {
            "kind": "iggy",
            "addresses": cfg["nodes"],
            "request_timeout_s": cfg["timeout_s"],
            "connect_timeout_s": cfg["timeout_s"],
            "heartbeat_interval_s": cfg["heartbeat_s"],
            "start_jitter_s": cfg["jitter_s"],
        }
        iggy |= cfg["creds"][self.id]  # its own user's password, or its token
        self.settings: Settings = parse_config(
            {
                "gateway_id": self.id,
                "state_dir": str(state),
                "iggy": iggy,
                "buffer": {"synchronous": "normal"},
                "downlink": {"poll_interval_s": cfg["poll_interval_s"]},
                "metrics": {"enabled": False},
            },
            env={},
        )
        self.metrics = Metrics()
        if cfg["separate"]:
            self.uplink = factory.make_uplink(self.settings)
            self.source = factory.make_command_source(self.settings)
        else:
            self.uplink, self.source = factory.make_uplink_and_source(self.settings)
        self.box: Outbox | None = None
        self.inbox: Inbox | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.forwarder: Forwarder | None = None
        self.ready_at: float | None = None  # wall clock: first record confirmed by Iggy
        self.errors_before_ready = 0
        self.failures: Counter[str] = Counter()  # SDK calls that failed before ready (CountingClient)
        self.stored: list[float] = []  # wall clock: a poll stored something in the inbox

    async def open(self) -> None:
        self.box = await Outbox.open(self.settings.buffer_path, self.settings.buffer, self.id, self.metrics)
        self.box.start()
        self.inbox = await Inbox.open(self.settings.buffer_path, self.settings)
        route = Route("edge", "telemetry", f"{self.id}-dev0")
        now_us = time.time_ns() // 1000
        await self.box.submit(Incoming(route, f"edge/{route.key}/up/env", 1, False, now_us, b'{"t":1}', 1))

    def start(self) -> None:
        assert self.box is not None
        assert self.inbox is not None
        assert self.uplink is not None
        assert self.source is not None
        self.forwarder = Forwarder(self.box, self.uplink, self.settings.forward, self.metrics)
        poll = ReturnPoll(
            self.settings,
            self.source,
            self.inbox,
            self.box,
            self.metrics,
            on_stored=lambda: self.stored.append(time.time()),
        )
        token = GATEWAY.set(self)
        self.tasks = [
            asyncio.create_task(self.forwarder.run(), name=f"forward-{self.id}"),
            asyncio.create_task(poll.run(), name=f"poll-{self.id}"),
        ]
        GATEWAY.reset(token)

    def check_ready(self) -> bool:
        if self.ready_at is None and self.metrics.value("iggy_edge_forward_records_total") > 0:
            self.ready_at = time.time()
            self.errors_before_ready = error_count(self.metrics)
        return self.ready_at is not None

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            if self.uplink is not None:
                await self.uplink.close()
            if self.source is not None:
                await self.source.close()
        if self.inbox is not None:
            await self.inbox.close()
        if self.box is not None:
            await self.box.close()


def _where(task: asyncio.Task[None]) -> str:
    """The innermost frame a task is suspended in (file:line function)."""
    if task.done():
        return "done: " + repr(task.exception() if not task.cancelled() else "cancelled")[:200]
    stack = task.get_stack(limit=None)
    if not stack:
        return "?"
    return " <- ".join(
        f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}" for f in stack[-3:]
    )


def say(**event: Any) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def main(cfg: dict[str, Any]) -> None:
    connection.IggyClient = CountingClient  # type: ignore[misc,assignment]
    workdir = Path(cfg["workdir"])
    gateways = [Gateway(i, workdir, cfg) for i in range(cfg["first"], cfg["first"] + cfg["count"])]
    for g in gateways:  # one at a time: opening is not what is measured
        await g.open()
    say(event="built", gateways=len(gateways), pid=os.getpid())
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    watcher: asyncio.Task[None] | None = None

    async def watch_ready() -> None:
        waiting = list(gateways)
        while waiting:
            await asyncio.sleep(0.05)
            done = [g for g in waiting if g.check_ready()]
            for g in done:
                say(event="ready", gw=g.id, at=g.ready_at, errors=g.errors_before_ready, failures=g.failures)
            waiting = [g for g in waiting if g.ready_at is None]

    while True:
        line = await reader.readline()
        if not line:
            break  # the orchestrator is gone
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "go":
            await asyncio.sleep(max(0.0, msg["at"] - time.time()))
            for g in gateways:
                g.start()
            watcher = asyncio.create_task(watch_ready())
        elif cmd == "counts":
            live, hb = heartbeats_per_s()
            conns = sum(c.connected_at is not None for c in LIVE)
            say(
                event="counts",
                at=time.monotonic(),  # CLOCK_MONOTONIC: one clock for every process of the machine
                calls=dict(CALLS),
                connected=live,
                heartbeats_per_s=round(hb, 3),
                clients=conns,
                cpu_s=time.process_time(),
                errors=sum(error_count(g.metrics) for g in gateways),
            )
        elif cmd == "stuck":  # where the gateways not ready yet are waiting
            out = {}
            for g in gateways:
                if g.ready_at is None:
                    frames = {t.get_name().split("-")[0]: _where(t) for t in g.tasks}
                    out[g.id] = {"errors": error_count(g.metrics), "waiting": frames}
            say(event="stuck", stuck=out)
        elif cmd == "stored":
            say(event="stored", stored={g.id: g.stored for g in gateways if g.stored})
        elif cmd == "stop":
            break
    if watcher is not None:
        watcher.cancel()
    await asyncio.gather(*(g.close() for g in gateways), return_exceptions=True)
    say(event="stopped")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the bench


if __name__ == "__main__":
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(message)s")
    asyncio.run(main(json.loads(sys.argv[1])))
