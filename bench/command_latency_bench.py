"""Command latency: `command send` -> the device's MQTT subscription, under
traffic and at rest, and the return path's requests to Iggy.

Per run: an outbox is filled with `--records` telemetry records (10 devices,
60-byte JSON, through `Outbox.submit`), then the real agent (`Agent` with the
return-path component, default settings apart from the poll interval) starts
against a private Mosquitto.  With a real server the gateway is first
provisioned as the cloud side does it (`cloud/provision.py`, root login: its
return-path topic and a least-privileged user) and the agent runs as that
user.  The forwarder starts draining at once; every `--every-ms` the cloud
side sends one command (kind header ``command``, the gateway's one
return-path partition) to one of 10 devices, and a gmqtt subscriber standing
in for the devices stamps its arrival.  Latency = arrival - the moment the
send began (for a real server: before the IggyCommandSink request).
After one warm-up command (waited for, not counted: the return poll is then
in the fast cadence it keeps while commands flow), commands sent while the
backlog was still draining count as "busy"; the same
run continues after the drain for an "idle" figure of the same kind (both:
commands under traffic, the return poll in its fast cadence).  Then nothing
is sent for QUIET_S: the requests per second at rest.  Last, `--rest-commands`
single commands, each after a random 3.1-4.1 s of silence (longer than the
fast cadence lasts after a command, HOT_INTERVALS x the default 1 s poll
interval, and spread uniformly over the 1 s poll cycle): the "rest" figure,
what a command nobody saw coming waits.

Requests: every request the return path makes, counted at its
`CommandSource` (polls, looks at a topic, offset mirrors), per phase.  The
SDK's heartbeat (a PING every 5 s per connection, 0.2/s) is the
connection's, not the return path's, and is not in these counts.

Iggy: `MemoryIggy` in process, and a real `iggy-server` when it is on PATH
(tests/support/iggy_server.py starts it); otherwise a "skipped" line.

    .venv/bin/python bench/command_latency_bench.py [--records N] [--rest-commands N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge.cloud.provision import provision_gateway
from iggy_edge.config import parse_config
from iggy_edge.downlink import return_path
from iggy_edge.downlink.commands import make_command, return_topic
from iggy_edge.downlink.poll import HOT_INTERVALS
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.runtime import Agent
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.iggy import IggyCommandSink, IggyCommandSource, IggyUplink
from iggy_edge.uplink.memory import MemoryIggy
from iggy_edge.uplink.protocol import CommandSource, PolledMessage
from pydantic import SecretStr

from bench._common import Broker, emit, emit_machine, payload_60, skipped
from bench._common import broker as make_broker
from tests.support.iggy_server import IggyServer
from tests.support.wait import async_wait_until

BENCH = "command_latency"
DEVICES = 10
QUIET_S = 10.0
COOL_S = HOT_INTERVALS * 1.0 + 1.0  # > the fast cadence after a command, at the default poll interval


class Counting:
    """A `CommandSource` that counts every request it passes on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.polls = self.looks = self.mirrors = 0

    @property
    def requests(self) -> int:
        return self.polls + self.looks + self.mirrors

    async def start(self) -> None:
        await self.inner.start()

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        self.polls += 1
        got: list[PolledMessage] = await self.inner.poll(stream, topic, partition_id, offset, count)
        return got

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        self.looks += 1
        got: dict[int, int] | None = await self.inner.last_offsets(stream, topic)
        return got

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        self.mirrors += 1
        await self.inner.mirror_offset(stream, topic, partition_id, offset)

    async def reachable(self, timeout: float) -> bool:
        ok: bool = await self.inner.reachable(timeout) if hasattr(self.inner, "reachable") else True
        return ok

    async def close(self) -> None:
        await self.inner.close()


def _settings(state: Path, broker: Broker, poll_s: float, iggy: dict[str, Any]) -> Any:
    return parse_config(
        {
            "gateway_id": "bench",
            "state_dir": str(state),
            "mqtt": {"host": broker.host, "port": broker.port},
            "iggy": iggy,
            "downlink": {"poll_interval_s": poll_s},
            "metrics": {"enabled": False},
        },
        env={},
    )


async def fill(settings: Any, records: int) -> None:
    box = await Outbox.open(settings.buffer_path, settings.buffer, settings.gateway_id, Metrics())
    box.start()
    routes = [Route("edge", "telemetry", f"dev{d}") for d in range(DEVICES)]
    topics = [f"edge/dev{d}/up/env" for d in range(DEVICES)]
    now_us = time.time_ns() // 1000
    for lo in range(0, records, 20_000):
        done = None
        for i in range(lo, min(records, lo + 20_000)):
            d, seq = i % DEVICES, i // DEVICES + 1
            done = box.submit(Incoming(routes[d], topics[d], 1, False, now_us, payload_60(d, seq), seq))
        assert done is not None
        await done
    await box.close()


def pct(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def run_once(
    workdir: Path,
    broker: Broker,
    records: int,
    poll_s: float,
    every_s: float,
    idle_commands: int,
    kind: str,
    rest_commands: int,
) -> dict[str, Any]:
    server = None
    if kind == "server":
        server = IggyServer(workdir / "iggy").start()
        iggy_conf: dict[str, Any] = {
            "kind": "iggy",
            "address": server.address,
            "username": server.username,
            "password": server.password,
        }
    else:
        iggy_conf = {"kind": "memory"}
    settings = _settings(workdir / "state", broker, poll_s, iggy_conf)
    rt = return_topic(settings)
    admin = settings
    if server is not None:  # the cloud side provisions; the agent runs as the gateway's user
        done = await provision_gateway(settings, settings.gateway_id)
        assert done.password is not None
        gateway_iggy = settings.iggy.model_copy(
            update={"username": done.username, "password": SecretStr(done.password), "create_missing": False}
        )
        settings = settings.model_copy(update={"iggy": gateway_iggy})
    await fill(settings, records)

    sent_at: dict[str, float] = {}
    arrived: dict[str, float] = {}

    all_arrived = asyncio.Event()

    def on_message(client: Any, topic: str, payload: bytes, qos: int, properties: Any) -> int:
        arrived.setdefault(json.loads(payload)["id"], time.perf_counter())
        if len(arrived) == len(sent_at):
            all_arrived.set()
        return 0

    dev = gmqtt.Client(f"bench-devices-{kind}-{poll_s}", clean_session=True)
    dev.on_message = on_message
    await dev.connect(broker.host, broker.port, version=MQTTv50)
    dev.subscribe("edge/+/down/cmd", qos=1)

    memory = MemoryIggy(keep_payloads=False)
    sink = None
    if kind == "server":
        uplink: Any = IggyUplink(settings.iggy, settings.gateway_id, topics=[("edge", "telemetry")])
        inner: CommandSource = IggyCommandSource(settings.iggy, settings.gateway_id, consumer_name(settings))
        sink = IggyCommandSink(admin.iggy)
        await sink.start()
    else:
        memory.create_topic(rt.stream, rt.topic, 1)
        uplink, inner = memory.uplink(), memory.command_source(consumer_name(settings))
    source = Counting(inner)
    agent = Agent(settings, uplink=uplink, command_source=source, components=(return_path,))
    task = asyncio.create_task(agent.run())
    await agent.ready.wait()
    # Measured from the return path's first poll on: its start (inbox, Iggy
    # login, the topic check) is not what a command waits for later.
    await async_wait_until(lambda: source.polls > 0, 30, interval=0.005, what="the return path's first poll")
    busy: list[str] = []
    idle: list[str] = []
    drained_at = None
    requests: dict[str, tuple[float, int, int, int]] = {}  # phase -> (seconds, polls, looks, mirrors)

    def load() -> tuple[float, int, int, int]:
        return time.perf_counter(), source.polls, source.looks, source.mirrors

    def phase(name: str, since: tuple[float, int, int, int]) -> tuple[float, int, int, int]:
        now = load()
        requests[name] = (now[0] - since[0], now[1] - since[1], now[2] - since[2], now[3] - since[3])
        return now

    async def send(i: int) -> str:
        cmd = make_command(f"dev{i % DEVICES}", "bench", {"i": i})
        sent_at[cmd.id] = time.perf_counter()
        all_arrived.clear()  # set again by on_message once this one is in too
        if sink is not None:
            await sink.publish(rt.stream, rt.topic, rt.partition, cmd.wire(), cmd.headers())
        else:
            memory.publish(rt.stream, rt.topic, rt.partition, cmd.wire(), cmd.headers())
        return cmd.id

    i = 0
    rest: list[str] = []
    rng = random.Random(23)
    # One command first, waited for: the return poll is then in its fast
    # cadence, as it is while commands flow; what the first command of a
    # burst waits is the "rest" figure below.
    warm = await send(i)
    i += 1
    await asyncio.wait_for(all_arrived.wait(), 30)
    assert warm in arrived
    started = time.perf_counter()
    mark = load()
    try:
        while True:
            assert agent.outbox is not None
            draining = agent.outbox.records > 0
            if not draining and drained_at is None:
                drained_at = mark = phase("busy", mark)
            if not draining and len(idle) >= idle_commands:
                break
            t0 = time.perf_counter()
            (busy if draining else idle).append(await send(i))
            i += 1
            await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - t0)))
        drain_s = time.perf_counter() - started
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_arrived.wait(), 60)
        mark = phase("after_drain", mark)
        await asyncio.sleep(COOL_S)  # the return poll looks faster for a while after a command
        mark = phase("cooling", mark)
        await asyncio.sleep(QUIET_S)  # no command for a while: what an idle gateway costs
        mark = phase("quiet", mark)
        for _ in range(rest_commands):  # one at a time, each after COOL_S..COOL_S+1 of silence
            await asyncio.sleep(COOL_S + rng.random())
            rest.append(await send(i))
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_arrived.wait(), 30)
        if rest_commands:
            phase("rest", mark)
    finally:
        agent.stop()
        await asyncio.wait_for(task, 60)
        await dev.disconnect()
        if sink is not None:
            await sink.close()
        if server is not None:
            server.stop()
    lost = [c for c in sent_at if c not in arrived]

    def lat(ids: list[str]) -> list[float]:
        return sorted((arrived[c] - sent_at[c]) * 1000 for c in ids if c in arrived)

    rates = {k: round((p + q + m) / t, 2) for k, (t, p, q, m) in requests.items()}
    detail = {
        k: {"s": round(t, 2), "polls": p, "looks": q, "mirrors": m} for k, (t, p, q, m) in requests.items()
    }
    return {
        "busy": lat(busy),
        "idle": lat(idle),
        "rest": lat(rest),
        "lost": len(lost),
        "drain_s": drain_s,
        "requests_per_s": rates,
        "requests": detail,
    }


def report(kind: str, poll_s: float, records: int, result: dict[str, Any]) -> None:
    for phase in ("busy", "idle", "rest"):
        values = result[phase]
        if phase == "rest" and poll_s != 1.0:
            continue  # measured at the default interval only (main)
        if not values:
            skipped(BENCH, f"{phase}_latency", "no commands sent in this phase (drain too short?)")
            continue
        extra = {
            "iggy": kind,
            "poll_interval_s": poll_s,
            "commands": len(values),
            "backlog_records": records if phase == "busy" else 0,
            "drain_s": round(result["drain_s"], 2),
            "lost": result["lost"],
        }
        emit(BENCH, f"{phase}_latency_p50", round(pct(values, 50), 1), "ms", **extra)
        emit(BENCH, f"{phase}_latency_p99", round(pct(values, 99), 1), "ms", **extra)
    # What the return path asks of Iggy per gateway: polls, looks at a topic
    # (one GET_TOPIC each) and offset mirrors, per second, in each phase:
    # "busy" and "after_drain" while a command goes out every --every-ms,
    # "cooling" the COOL_S after the last one, "quiet" the QUIET_S after that
    # (the value), "rest" the single commands (each followed by its own fast
    # cadence and mirror).  The SDK's heartbeats are not in it (docstring).
    emit(
        BENCH,
        "return_path_requests_per_s",
        result["requests_per_s"].get("quiet"),
        "requests/s",
        iggy=kind,
        poll_interval_s=poll_s,
        by_phase=result["requests_per_s"],
        counts=result["requests"],
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000, help="outbox backlog drained meanwhile")
    ap.add_argument("--every-ms", type=float, default=20.0, help="one command every this many ms")
    ap.add_argument("--idle-commands", type=int, default=100, help="commands sent after the drain")
    ap.add_argument(
        "--rest-commands", type=int, default=100, help="single commands after silence, at the end"
    )
    ap.add_argument(
        "--quick", action="store_true", help="10,000 records, 10 rest commands, default interval only"
    )
    ap.add_argument("--only", choices=["memory", "server"], help="one kind of Iggy")
    args = ap.parse_args()
    records = 10_000 if args.quick else args.records
    rest_commands = 10 if args.quick else args.rest_commands
    polls = [1.0] if args.quick else [1.0, 0.05]
    emit_machine(BENCH)
    kinds = ["memory"]
    if shutil.which("iggy-server"):
        kinds.append("server")
    else:
        skipped(BENCH, "server", "iggy-server not on PATH")
    if args.only:
        kinds = [k for k in kinds if k == args.only]
    with (
        tempfile.TemporaryDirectory(prefix="cmd-latency-") as tmp,
        make_broker(Path(tmp) / "broker") as broker,
    ):
        for kind in kinds:
            for poll_s in polls:
                work = Path(tmp) / f"{kind}-{poll_s}"
                every_s = args.every_ms / 1000
                # at rest the cadence is poll_s: single commands are measured at the default only
                rest = rest_commands if poll_s == 1.0 else 0
                result = await run_once(
                    work, broker, records, poll_s, every_s, args.idle_commands, kind, rest
                )
                report(kind, poll_s, records, result)


if __name__ == "__main__":
    asyncio.run(main())
