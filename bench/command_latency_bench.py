"""Command latency: `command send` -> the device's MQTT subscription, while the
uplink drains a 100,000-record backlog.

Per run: an outbox is filled with `--records` telemetry records (10 devices,
60-byte JSON, through `Outbox.submit`), then the real agent (`Agent` with the
return-path component, default settings apart from the poll interval) starts
against a private Mosquitto.  The forwarder starts draining at once; every
`--every-ms` the cloud side sends one command to one of 10 devices, and a
gmqtt subscriber standing in for the devices stamps its arrival.  Latency =
arrival - the moment the send began (for a real server: before the
IggyCommandSink request).  Only commands sent while the backlog was still
draining count as "busy"; the same run continues after the drain for an
"idle" figure of the same kind.  Then nothing is sent for a while (the
return path's request rate per second when quiet is measured), and last
`--cold-commands` single commands go out, each after COOL_S of silence: the
"cold" figure, a command nobody saw coming (the return poll looks faster for
a few seconds after a command, so the steady stream above is its best case
and this its worst).

Iggy: `MemoryIggy` in process, and a real `iggy-server` when it is on PATH
(tests/support/iggy_server.py starts it); otherwise a "skipped" line.

The poll interval (`downlink.poll_interval_s`, default 1.0 s) bounds the
latency from below by design: a command waits on average half an interval
for the next poll.  Both the default and 0.05 s are measured.

    .venv/bin/python bench/command_latency_bench.py [--records N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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
from iggy_edge.config import parse_config
from iggy_edge.downlink import return_path
from iggy_edge.downlink.commands import commands_topic, make_command, partition_of
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.runtime import Agent
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.iggy import IggyCommandSink, IggyCommandSource, IggyUplink
from iggy_edge.uplink.memory import MemoryIggy

from bench._common import Broker, emit, emit_machine, payload_60, skipped
from bench._common import broker as make_broker
from tests.support.iggy_server import IggyServer
from tests.support.wait import async_wait_until

BENCH = "command_latency"
DEVICES = 10
QUIET_S = 5.0
COOL_S = 4.0  # > downlink/poll.py's HOT_INTERVALS x the default poll interval


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
    cold_commands: int,
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
        source: Any = IggyCommandSource(settings.iggy, settings.gateway_id, consumer_name(settings))
        sink = IggyCommandSink(settings.iggy)
        await sink.start()
    else:
        uplink, source = memory.uplink(), memory.command_source(consumer_name(settings))
    agent = Agent(settings, uplink=uplink, command_source=source, components=(return_path,))
    task = asyncio.create_task(agent.run())
    await agent.ready.wait()
    # Measured from the return path's first poll on: its start (inbox, Iggy
    # login, the partition check) is not what a command waits for later.
    await async_wait_until(lambda: source.polls > 0, 30, interval=0.005, what="the return path's first poll")
    topic = commands_topic(settings)
    busy: list[str] = []
    idle: list[str] = []
    started = time.perf_counter()
    drained_at = None
    requests: dict[str, tuple[float, int, int]] = {}  # phase -> (seconds, polls, looks)

    def load() -> tuple[float, int, int]:
        return time.perf_counter(), source.polls, source.probes

    def phase(name: str, since: tuple[float, int, int]) -> tuple[float, int, int]:
        now = load()
        requests[name] = (now[0] - since[0], now[1] - since[1], now[2] - since[2])
        return now

    async def send(i: int) -> str:
        cmd = make_command(f"dev{i % DEVICES}", "bench", {"i": i})
        sent_at[cmd.id] = time.perf_counter()
        all_arrived.clear()  # set again by on_message once this one is in too
        if sink is not None:
            await sink.publish("edge", topic, partition_of(cmd.device, settings), cmd.wire())
        else:
            memory.publish("edge", topic, partition_of(cmd.device, settings), cmd.wire())
        return cmd.id

    mark = load()
    i = 0
    cold: list[str] = []
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
        phase("quiet", mark)
        for _ in range(cold_commands):  # one command at a time, each after COOL_S of silence
            cold.append(await send(i))
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_arrived.wait(), 30)
            await asyncio.sleep(COOL_S)
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

    rates = {k: round((p + q) / t, 1) for k, (t, p, q) in requests.items()}
    detail = {k: {"s": round(t, 2), "polls": p, "looks": q} for k, (t, p, q) in requests.items()}
    return {
        "busy": lat(busy),
        "idle": lat(idle),
        "cold": lat(cold),
        "lost": len(lost),
        "drain_s": drain_s,
        "requests_per_s": rates,
        "requests": detail,
    }


def report(kind: str, poll_s: float, records: int, result: dict[str, Any]) -> None:
    for phase in ("busy", "idle", "cold"):
        values = result[phase]
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
    # What the return path asks of Iggy per gateway: polls plus looks at a
    # topic (one GET_TOPIC each), per second, in each phase: "busy" and
    # "after_drain" while a command goes out every --every-ms, "cooling" the
    # COOL_S after the last one, "quiet" the QUIET_S after that (the value).
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
    ap.add_argument("--cold-commands", type=int, default=5, help="single commands after silence, at the end")
    ap.add_argument("--quick", action="store_true", help="10,000 records, default poll interval only")
    args = ap.parse_args()
    records = 10_000 if args.quick else args.records
    polls = [1.0] if args.quick else [1.0, 0.05]
    emit_machine(BENCH)
    kinds = ["memory"]
    if shutil.which("iggy-server"):
        kinds.append("server")
    else:
        skipped(BENCH, "server", "iggy-server not on PATH")
    with (
        tempfile.TemporaryDirectory(prefix="cmd-latency-") as tmp,
        make_broker(Path(tmp) / "broker") as broker,
    ):
        for kind in kinds:
            for poll_s in polls:
                work = Path(tmp) / f"{kind}-{poll_s}"
                every_s = args.every_ms / 1000
                result = await run_once(
                    work, broker, records, poll_s, every_s, args.idle_commands, kind, args.cold_commands
                )
                report(kind, poll_s, records, result)


if __name__ == "__main__":
    asyncio.run(main())
