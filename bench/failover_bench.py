"""Failover and recovery of the Iggy uplink, against a real `iggy-server`.

recovery_after_cut
    The real agent (default forward backoff: 0.5 s doubling to a 30 s cap)
    forwards QoS1 telemetry (50 msg/s) from a private Mosquitto to one
    iggy-server through a TCP proxy (tests/support/tcp_proxy.py).  The proxy
    cuts the link for `--cut` seconds (refuses new connections, breaks open
    ones), then lets it through again; the figure is the time from the link
    returning to the forwarder's next confirmed batch.  The reference is the
    same run with the recovery probe hidden from the forwarder (what the
    agent did before: wait out the backoff).

failover
    The same agent against a 3-node cluster (tests/support/iggy_server.py:
    roster in IGGY_CONFIG_PATH, `--replica-id N`, default cluster timings:
    heartbeat_timeout 5 s), all nodes in `[iggy] addresses`.  Under 150
    msg/s of QoS1 load the node the agent sends to is SIGKILLed; the figure
    is the time from the kill to the next confirmed batch on another node.

Skipped (a "skipped" line) when iggy-server is not on PATH.

    .venv/bin/python bench/failover_bench.py [--cut 60] [--repeat 3] [--only recovery|failover] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent"))

from iggy_edge.config import Settings, parse_config
from iggy_edge.records import OutboundRecord
from iggy_edge.runtime import Agent, build_agent
from iggy_edge.uplink.iggy import IggyUplink
from iggy_edge.uplink.protocol import Uplink

from bench._common import Broker, emit, emit_machine, skipped, spread
from bench._common import broker as make_broker
from tests.support.iggy_server import IggyCluster, IggyServer, busiest_peer, iggy_server_binary
from tests.support.mqtt import Publisher
from tests.support.tcp_proxy import TcpProxy

BENCH = "failover"


class WithoutProbe:
    """The uplink with its recovery probe hidden (the reference)."""

    def __init__(self, inner: Uplink) -> None:
        self.inner = inner

    async def start(self) -> None:
        await self.inner.start()

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        await self.inner.send(batch)

    async def close(self) -> None:
        await self.inner.close()


def settings(state: Path, broker: Broker, nodes: list[str], server: IggyServer) -> Settings:
    return parse_config(
        {
            "gateway_id": "bench",
            "state_dir": str(state),
            "mqtt": {"host": broker.host, "port": broker.port},
            "iggy": {
                "kind": "iggy",
                "addresses": nodes,
                "username": server.username,
                "password": server.password,
                "request_timeout_s": 5.0,
                "connect_timeout_s": 8.0,
            },
            "downlink": {"enabled": False},
            "metrics": {"enabled": False},
        },
        env={},
    )


async def load(pub: Publisher, rate: float, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        await pub.publish("edge/dev-1/up/t", json.dumps({"n": n}).encode(), tag=n)
        n += 1
        await asyncio.sleep(1 / rate)


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


async def run_agent(s: Settings, uplink: Uplink | None, broker: Broker, body: Any, rate: float) -> float:
    agent: Agent = build_agent(s, uplink=uplink)
    task = asyncio.create_task(agent.run())
    pub = await Publisher(broker.host, broker.port, "bench-load").connect()
    stop = asyncio.Event()
    feeder: asyncio.Task[None] | None = None
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        await asyncio.sleep(1.0)  # subscribed
        feeder = asyncio.create_task(load(pub, rate, stop))
        await until(
            lambda: agent.metrics.value("iggy_edge_forward_records_total") >= 50,
            60,
            "first records forwarded",
        )
        return float(await body(agent))
    finally:
        stop.set()
        if feeder is not None:
            await feeder
        await pub.close()
        agent.stop()
        await asyncio.wait_for(task, 30)


async def recovery_once(workdir: Path, cut_s: float, probe: bool) -> float:
    broker = make_broker(workdir / "broker").start()
    server = IggyServer(workdir / "iggy").start()
    proxy = await TcpProxy("127.0.0.1", server.port).start()
    try:
        s = settings(workdir / "state", broker, [proxy.address], server)
        uplink = IggyUplink(s.iggy, s.gateway_id)
        chosen: Uplink = uplink if probe else WithoutProbe(uplink)

        async def body(agent: Agent) -> float:
            fwd = agent.forwarder
            assert fwd is not None
            await proxy.cut()
            await asyncio.sleep(cut_s)
            await until(lambda: not fwd.up.is_set(), 30, "the cut noticed")
            await proxy.restore()
            back = time.monotonic()
            await asyncio.wait_for(fwd.up.wait(), 60)
            return time.monotonic() - back

        return await run_agent(s, chosen, broker, body, rate=50)
    finally:
        await proxy.stop()
        server.stop()
        broker.stop()


async def failover_once(workdir: Path) -> float:
    broker = make_broker(workdir / "broker").start()
    cluster = IggyCluster(workdir / "cluster").start()
    try:
        s = settings(workdir / "state", broker, cluster.addresses, cluster.nodes[0])

        async def body(agent: Agent) -> float:
            fwd = agent.forwarder
            assert fwd is not None
            victim = cluster.node_at(await busiest_peer(cluster.addresses))
            victim.kill()
            killed = time.monotonic()
            await until(lambda: not fwd.up.is_set(), 30, "the kill noticed")
            await asyncio.wait_for(fwd.up.wait(), 60)
            return time.monotonic() - killed

        try:
            return await run_agent(s, None, broker, body, rate=150)
        except TimeoutError:
            keep = os.environ.get("FAILOVER_BENCH_KEEP")
            if keep:  # the nodes' logs, for a look at a stalled cluster
                for node in cluster.nodes:
                    shutil.copy(node.log_path, Path(keep) / f"{workdir.name}-{node.workdir.name}.log")
            raise
    finally:
        cluster.stop()
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cut", type=float, default=60.0, help="seconds the link is cut")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("recovery", "failover"), help="measure only this")
    ap.add_argument("--quick", action="store_true", help="a 3 s cut, one run each (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.cut, args.repeat = 3.0, 1
    emit_machine(BENCH)
    if iggy_server_binary() is None:
        skipped(BENCH, "recovery_after_cut", "iggy-server not on PATH")
        skipped(BENCH, "failover", "iggy-server not on PATH")
        return
    with tempfile.TemporaryDirectory(prefix="failover-bench-") as tmp:
        root = Path(tmp)
        for probe in (True, False) if args.only != "failover" else ():
            runs = [
                asyncio.run(recovery_once(root / f"cut-{probe}-{i}", args.cut, probe))
                for i in range(args.repeat)
            ]
            emit(
                BENCH,
                "recovery_after_cut" if probe else "recovery_after_cut_without_probe",
                spread(runs, 2)["median"],
                "s",
                cut_s=args.cut,
                **spread(runs, 2),
            )
        if args.only == "recovery":
            return
        runs, stalled = [], 0
        for i in range(args.repeat):
            try:
                runs.append(asyncio.run(failover_once(root / f"failover-{i}")))
            except TimeoutError as e:
                # Seen once in ~15 fresh clusters: no write confirmed within
                # 60 s of the start, before any kill.  Counted, not hidden.
                print(f"failover run {i}: {e}", file=sys.stderr)
                stalled += 1
        if runs:
            figures = spread(runs, 2)
            emit(BENCH, "failover", figures["median"], "s", nodes=3, stalled=stalled, **figures)
        else:
            emit(BENCH, "failover", None, "s", nodes=3, stalled=stalled)


if __name__ == "__main__":
    main()
