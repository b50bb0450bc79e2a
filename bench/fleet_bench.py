"""Fleet scale: many gateways' uplinks against one Iggy server and a 3-node cluster.

Every gateway is what the agent runs on the Iggy side, in one process: its
own outbox (a SQLite file, `Outbox`), the real `Forwarder` with default
`[forward]` settings and its own `IggyUplink` (its own connection), and its
return-path reader (`IggyCommandSource`, its own connection) that creates and
polls ``commands.<gw>`` and ``config.<gw>`` -- ``iggy.partitions`` (3)
partitions each, every ``--poll-interval`` (the agent's default 1 s), as
the agent's return poll does.  The shared topics (telemetry, acks, events)
are created by the first uplink that needs them.

Phases, per target (``single``: one iggy-server; ``cluster``: three nodes,
every gateway given all three addresses):

setup   every gateway's uplink and return-path topics created at once; the
        figure is the wall time and the topic count the server then holds.
drain   every outbox holds ``--backlog`` records (60-byte JSON, 10 devices);
        all forwarders start together; aggregate records/s until every
        outbox is empty.
steady  every gateway ingests ``--rate`` records/s for ``--seconds`` while
        its return path polls; per record, latency = Iggy's confirmation
        (the send returning) - the record's receive time (its
        ``received-at-us`` header: the outbox's group commit, the
        forwarder's linger and the send).  Per gateway p50 / p99, and the
        spread of those over the fleet; achieved polls/s and poll latency.

Each phase also reads the servers' RSS (VmRSS of every node, /proc).  The
reference, in the same run on the same server / cluster: one gateway alone
(target ``single-reference`` / ``cluster-reference``), run first, so its RSS
"before" is the idle server's.  Load on the machine is printed with
the figures (``machine`` line, load average).

    .venv/bin/python bench/fleet_bench.py [--gateways 50] [--only single|cluster] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import emit, emit_machine, payload_60, skipped
from iggy_edge.config import IggySettings, Settings, parse_config
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import HEADER_RECEIVED_US, OutboundRecord, Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.iggy import IggyCommandSource, IggyProbe, IggyUplink
from iggy_edge.uplink.protocol import UplinkError
from pydantic import SecretStr

from tests.support.iggy_server import ROOT_PASSWORD, ROOT_USER, IggyCluster, IggyServer, iggy_server_binary

BENCH = "fleet"
DEVICES = 10
SHARED_TOPICS = (("edge", "telemetry"), ("edge", "acks"), ("edge", "events"))


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process (/proc/<pid>/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TimedUplink:
    """The gateway's IggyUplink; on every confirmed send, each record's
    latency since it was received (its received-at-us header)."""

    def __init__(self, inner: IggyUplink) -> None:
        self.inner = inner
        self.latencies_ms: list[float] = []
        self.recording = False

    async def start(self) -> None:
        await self.inner.start()

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        await self.inner.send(batch)
        if self.recording:
            now_us = time.time_ns() // 1000
            self.latencies_ms.extend((now_us - int(r.headers[HEADER_RECEIVED_US])) / 1000 for r in batch)

    async def close(self) -> None:
        await self.inner.close()


class Gateway:
    def __init__(self, index: int, workdir: Path, nodes: list[str]) -> None:
        self.id = f"gw-{index:05d}"
        self.state = workdir / self.id
        self.state.mkdir(parents=True)
        self.settings: Settings = parse_config(
            {
                "gateway_id": self.id,
                "state_dir": str(self.state),
                "iggy": {
                    "kind": "iggy",
                    "addresses": nodes,
                    "username": ROOT_USER,
                    "password": ROOT_PASSWORD,
                    "request_timeout_s": 30.0,
                    "connect_timeout_s": 30.0,
                },
                "buffer": {"synchronous": "normal"},
                "metrics": {"enabled": False},
            },
            env={},
        )
        self.metrics = Metrics()
        dl = self.settings.downlink
        self.return_topics = [f"{dl.commands_topic}.{self.id}", f"{dl.config_topic}.{self.id}"]
        self.stream = dl.stream
        # The command source creates no topic any more: the uplink (root) makes them.
        made = [*SHARED_TOPICS, *((self.stream, t) for t in self.return_topics)]
        self.uplink = TimedUplink(IggyUplink(self.settings.iggy, self.id, topics=made))
        self.source = IggyCommandSource(self.settings.iggy, self.id, f"iggy-edge-{self.id}")
        self.box: Outbox | None = None
        self.forwarder: Forwarder | None = None
        self.task: asyncio.Task[None] | None = None
        self.polls = 0
        self.poll_errors = 0
        self.poll_ms: list[float] = []
        self.next_seq = 0

    async def open(self) -> None:
        self.box = await Outbox.open(self.state / "buffer.db", self.settings.buffer, self.id, self.metrics)
        self.box.start()

    async def setup(self) -> None:
        """Connect both directions and create the topics as the agent does."""
        await self.uplink.start()
        for topic in self.return_topics:
            for p in range(self.settings.iggy.partitions):
                await self.source.poll(self.stream, topic, p, 0, 1)

    def submit(self, n: int) -> Any:
        assert self.box is not None
        done = None
        now_us = time.time_ns() // 1000
        for _ in range(n):
            self.next_seq += 1
            d = self.next_seq % DEVICES
            route = Route("edge", "telemetry", f"{self.id}-dev{d}")
            done = self.box.submit(
                Incoming(
                    route,
                    f"edge/{route.key}/up/env",
                    1,
                    False,
                    now_us,
                    payload_60(d, self.next_seq),
                    self.next_seq,
                )
            )
        return done

    def start_forwarding(self) -> None:
        assert self.box is not None
        self.forwarder = Forwarder(self.box, self.uplink, self.settings.forward, self.metrics)
        self.task = asyncio.create_task(self.forwarder.run(), name=f"forward-{self.id}")

    async def poll_loop(self, interval: float, stop: asyncio.Event) -> None:
        """The return poll's request pattern: every interval, each partition of both topics."""
        while not stop.is_set():
            started = time.perf_counter()
            for topic in self.return_topics:
                for p in range(self.settings.iggy.partitions):
                    t0 = time.perf_counter()
                    try:
                        await self.source.poll(self.stream, topic, p, 0, self.settings.downlink.poll_batch)
                        self.polls += 1
                        self.poll_ms.append((time.perf_counter() - t0) * 1000)
                    except UplinkError:
                        self.poll_errors += 1
            left = interval - (time.perf_counter() - started)
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), left)

    async def close(self) -> None:
        if self.forwarder is not None and self.task is not None:
            self.forwarder.stop()
            await self.task
        await self.uplink.close()
        await self.source.close()
        if self.box is not None:
            await self.box.close()


async def topic_count(address: str, stream: str) -> int:
    settings = IggySettings(
        kind="iggy", address=address, username=ROOT_USER, password=SecretStr(ROOT_PASSWORD)
    )
    async with IggyProbe(settings, timeout_s=30.0) as probe:
        details = await probe.stream(stream)
    return 0 if details is None else int(details.topics_count)


async def run_fleet(
    target: str, n: int, pids: list[int], nodes: list[str], args: argparse.Namespace, workdir: Path
) -> None:
    """One fleet of `n` gateways against `nodes`; `target` labels its figures."""
    rss = round(sum(rss_mb(p) for p in pids), 1)
    emit(BENCH, "server_rss_before", rss, "MB", target=target, nodes=len(pids), gateways=n)
    gateways = [Gateway(i, workdir / target, nodes) for i in range(n)]
    await asyncio.gather(*(g.open() for g in gateways))
    try:
        # Every gateway connects and creates its topics at once (a fleet
        # starting together, or reconnecting after a cluster restart); one
        # that does not get through within its connect / request timeout
        # (30 s) is counted and set up again afterwards, one at a time.
        started = time.perf_counter()
        each: list[float] = []
        failed: list[tuple[Gateway, str]] = []

        gate = asyncio.Semaphore(args.setup_concurrency or n)

        async def setup(g: Gateway) -> None:
            t0 = time.perf_counter()
            try:
                async with gate:
                    await g.setup()
            except UplinkError as e:
                failed.append((g, str(e)[:160]))
                return
            each.append(time.perf_counter() - t0)

        await asyncio.gather(*(setup(g) for g in gateways))
        setup_s = time.perf_counter() - started
        for g, _ in failed:
            await g.setup()
        topics = await topic_count(nodes[0], "edge")
        emit(
            BENCH,
            "setup_seconds",
            round(setup_s, 2),
            "s",
            target=target,
            gateways=n,
            per_gateway_p50=round(pct(each, 0.5), 2),
            per_gateway_max=round(max(each, default=float("nan")), 2),
            concurrency=args.setup_concurrency or n,
            timed_out=len(failed),
            first_error=failed[0][1] if failed else None,
        )
        emit(
            BENCH,
            "topics",
            topics,
            "topics",
            target=target,
            gateways=n,
            per_gateway=2,
            shared=len(SHARED_TOPICS),
            partitions=topics * gateways[0].settings.iggy.partitions,
        )
        emit(BENCH, "server_rss_after_setup", round(sum(rss_mb(p) for p in pids), 1), "MB", target=target)

        # drain: a backlog in every outbox, every forwarder at once
        await asyncio.gather(*(g.submit(args.backlog) for g in gateways))
        started = time.perf_counter()
        for g in gateways:
            g.start_forwarding()
        while any(g.box is not None and g.box.records > 0 for g in gateways):  # noqa: ASYNC110 - the stopwatch
            await asyncio.sleep(0.05)
        drain_s = time.perf_counter() - started
        total = n * args.backlog
        sent = sum(g.metrics.value("iggy_edge_forward_records_total") for g in gateways)
        emit(
            BENCH,
            "drain_rate",
            round(total / drain_s),
            "records/s",
            target=target,
            gateways=n,
            backlog_per_gateway=args.backlog,
            seconds=round(drain_s, 2),
            forwarded=int(sent),
        )
        emit(BENCH, "server_rss_after_drain", round(sum(rss_mb(p) for p in pids), 1), "MB", target=target)

        # steady: ingest at a rate, return path polling
        stop = asyncio.Event()
        for g in gateways:
            g.uplink.recording = True
        pollers = [asyncio.create_task(g.poll_loop(args.poll_interval, stop)) for g in gateways]

        async def ingest(g: Gateway) -> None:
            step = 0.1
            per_step = args.rate * step
            owed = 0.0
            while not stop.is_set():
                owed += per_step
                k = int(owed)
                owed -= k
                if k:
                    g.submit(k)
                await asyncio.sleep(step)

        feeders = [asyncio.create_task(ingest(g)) for g in gateways]
        t0 = time.perf_counter()
        cpu0 = [cpu_seconds(p) for p in pids], cpu_seconds()
        await asyncio.sleep(args.seconds)
        cpu1 = [cpu_seconds(p) for p in pids], cpu_seconds()
        stop.set()
        await asyncio.gather(*feeders, *pollers)
        steady_s = time.perf_counter() - t0
        # Who is busy: the servers' and this process's (every gateway's) CPU, in cores.
        emit(
            BENCH,
            "steady_cpu",
            round((sum(cpu1[0]) - sum(cpu0[0])) / args.seconds, 2),
            "cores (servers)",
            target=target,
            per_node=[round((b - a) / args.seconds, 2) for a, b in zip(cpu0[0], cpu1[0], strict=True)],
            gateways_process=round((cpu1[1] - cpu0[1]) / args.seconds, 2),
        )
        # let the last records go out before reading the latencies
        deadline = time.monotonic() + 30
        while any(g.box is not None and g.box.records > 0 for g in gateways) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        per_gw_p50 = [pct(g.uplink.latencies_ms, 0.5) for g in gateways if g.uplink.latencies_ms]
        per_gw_p99 = [pct(g.uplink.latencies_ms, 0.99) for g in gateways if g.uplink.latencies_ms]
        every = [x for g in gateways for x in g.uplink.latencies_ms]
        emit(
            BENCH,
            "steady_latency_p50",
            round(pct(every, 0.5), 1),
            "ms",
            target=target,
            gateways=n,
            rate_per_gateway=args.rate,
            records=len(every),
            aggregate_rate=round(len(every) / steady_s),
            per_gateway_p50_median=round(statistics.median(per_gw_p50), 1),
            per_gateway_p50_worst=round(max(per_gw_p50), 1),
        )
        emit(
            BENCH,
            "steady_latency_p99",
            round(pct(every, 0.99), 1),
            "ms",
            target=target,
            per_gateway_p99_median=round(statistics.median(per_gw_p99), 1),
            per_gateway_p99_worst=round(max(per_gw_p99), 1),
        )
        polls = sum(g.polls for g in gateways)
        poll_ms = [x for g in gateways for x in g.poll_ms]
        emit(
            BENCH,
            "polls_per_second",
            round(polls / steady_s, 1),
            "polls/s",
            target=target,
            expected=round(n * 2 * gateways[0].settings.iggy.partitions / args.poll_interval, 1),
            errors=sum(g.poll_errors for g in gateways),
            poll_p50_ms=round(pct(poll_ms, 0.5), 2),
            poll_p99_ms=round(pct(poll_ms, 0.99), 2),
        )
        emit(
            BENCH,
            "server_rss_steady",
            round(sum(rss_mb(p) for p in pids), 1),
            "MB",
            target=target,
            per_node=[round(rss_mb(p), 1) for p in pids],
            topics=await topic_count(nodes[0], "edge"),
        )
    finally:
        await asyncio.gather(*(g.close() for g in gateways), return_exceptions=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateways", type=int, default=50)
    ap.add_argument("--backlog", type=int, default=5000, help="records per gateway for the drain phase")
    ap.add_argument("--rate", type=float, default=10.0, help="records/s per gateway in the steady phase")
    ap.add_argument("--seconds", type=float, default=15.0, help="length of the steady phase")
    ap.add_argument("--poll-interval", type=float, default=1.0)
    ap.add_argument("--setup-concurrency", type=int, default=0, help="gateways setting up at once (0: all)")
    ap.add_argument("--only", choices=["single", "cluster"])
    ap.add_argument("--quick", action="store_true", help="10 gateways, small phases (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.gateways, args.backlog, args.seconds = 10, 200, 3.0
    emit_machine(BENCH)
    if iggy_server_binary() is None:
        skipped(BENCH, "fleet", "iggy-server not on PATH (see tests/support/iggy_server.py to build it)")
        return
    workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    try:
        if args.only in (None, "single"):
            server = IggyServer(workdir / "iggy").start()
            try:
                assert server.proc is not None
                pids = [server.proc.pid]
                for label, n in (("single-reference", 1), ("single", args.gateways)):
                    asyncio.run(run_fleet(label, n, pids, [server.address], args, workdir))
            finally:
                server.stop()
        if args.only in (None, "cluster"):
            cluster = IggyCluster(workdir / "cluster").start()
            try:
                pids = [node.proc.pid for node in cluster.nodes if node.proc is not None]
                for label, n in (("cluster-reference", 1), ("cluster", args.gateways)):
                    asyncio.run(run_fleet(label, n, pids, cluster.addresses, args, workdir))
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load1, _, _ = os.getloadavg()
    emit(BENCH, "load_after", round(load1, 2), "loadavg_1m")


if __name__ == "__main__":
    main()
