"""Fleet scale: many gateways against a real 3-node Iggy cluster (issue 23).

The gateways are simulated with the agent's real uplink and return-path
code, in ``--procs`` processes of their own (bench/_fleet_gateways.py: per
gateway its own SQLite buffer, the real `Forwarder`, `ReturnPoll`, and the
uplink and command source `make_uplink_and_source` builds).  This process
only starts the servers, tells the gateway processes when to start, and
measures; the servers' figures are read from /proc and the kernel's socket
counters, apart from the gateways' own (their CPU is printed, so a saturated
machine shows).

Phases and figures (one JSON line each, ``emit``):

provision  every gateway provisioned as the cloud side does it
        (``--provision passes``, the default: `provision_gateways`, all
        return-path topics, then all users, then with ``--login token``
        all personal access tokens; ``--provision each``: `provision_gateway`
        for one gateway after another, ``--provision-at-once`` at a time),
        the admin dialing the leader; ``provision_s`` and the nodes' RSS
        after it.  With ``--restart`` the cluster is then restarted on its
        data (it sheds what ``--provision each`` leaves on the leader, and it
        shows what a cluster restart does to the figures below: some
        partitions' primaries end up away from the node the clients use,
        docs/scaling.md, run E).
setup   every gateway starts at the same instant (``--start-jitter``: the
        agent's own first-connect jitter, `iggy.start_jitter_s`), each with
        one record in its outbox.  ``ready_s``: from that instant to every
        gateway having had its first record confirmed by Iggy (p50 too).
        ``setup_timed_out``: gateways one of whose SDK calls (connect,
        login, look-up, send, poll) ran out of its timeout (``--timeout``,
        the agent's connect/request timeout) before they were ready, plus
        those not ready after ``--ready-timeout``; gateways whose start
        failed otherwise and was retried (the agent's error metrics), and
        the failed calls by kind, are printed with it.
        ``server_rss_after_setup_per_node``: VmRSS of each node (MB; the
        value is the largest).
rest    after ``--settle`` s, ``--rest`` s with no traffic.
        ``requests_at_rest_per_gateway``: requests per second per gateway,
        counted twice: at the SDK call boundary in the gateway processes
        (every call, plus the heartbeats of the connected clients at their
        interval) and, the figure, by the servers' sockets: the segments
        carrying data that the nodes' client-port sockets received
        (``ss -ti`` data_segs_in; the SDK writes a request in one flush and
        waits for its answer, so one segment is one request).  Also the
        connections per gateway and the servers' CPU.
command ``--commands`` commands at rest, one every ``--command-every`` s,
        each to another gateway chosen at random (each idle: the cold case),
        published by a cloud-side `IggyCommandSink`; latency = stored in the
        gateway's inbox (the return poll's commit) - the publish's start.
        ``command_latency_at_rest_p50`` / ``_p99``.

    flock /work/bench.lock .venv/bin/python bench/fleet_bench.py --gateways 1000 --only cluster
    .venv/bin/python bench/fleet_bench.py --quick          # 20 gateways, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import emit, emit_machine, skipped
from _fleet_server import (
    anon_mb,
    connections_and_requests,
    cpu_seconds,
    pct,
    provision,
    publish_command,
    rss_mb,
    topic_count,
)
from iggy_edge.config import IggySettings
from iggy_edge.uplink.iggy import IggyCommandSink
from iggy_edge.uplink.protocol import UplinkError
from pydantic import SecretStr

from tests.support.iggy_server import (
    ROOT_PASSWORD,
    ROOT_USER,
    IggyCluster,
    IggyServer,
    iggy_server_binary,
    stop_on_signals,
)

BENCH = "fleet"
WORKER = Path(__file__).resolve().parent / "_fleet_gateways.py"


class Workers:
    """The gateway processes and their JSON-line control channel."""

    def __init__(self, cfgs: list[dict[str, Any]]) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "agent")}
        # The gateways' warnings go to a log file each (a fleet failing to
        # start writes thousands); `log_summary` counts them.
        self.logs = [Path(c["workdir"]) / f"gateways-{i}.log" for i, c in enumerate(cfgs)]
        self.logs[0].parent.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for c, log in zip(cfgs, self.logs, strict=True):
            with log.open("w") as err:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), json.dumps(c)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        env=env,
                        bufsize=1,
                    )
                )
        self.pids = [p.pid for p in self.procs]
        self.queues: list[queue.Queue[dict[str, Any] | None]] = [queue.Queue() for _ in self.procs]
        for p, q in zip(self.procs, self.queues, strict=True):
            threading.Thread(target=self._pump, args=(p, q), daemon=True).start()

    def send(self, **cmd: Any) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()

    def _pump(self, proc: subprocess.Popen[str], q: queue.Queue[dict[str, Any] | None]) -> None:
        """A thread per process: its stdout lines, parsed, into its queue
        (None at its end).  A thread rather than select(): a text pipe's
        buffer can hold lines select() no longer reports."""
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(json.loads(line))
        q.put(None)

    def read(self, i: int, timeout: float | None = None) -> dict[str, Any] | None:
        """The next event of process `i` (None after `timeout`)."""
        try:
            msg = self.queues[i].get(timeout=timeout)
        except queue.Empty:
            return None
        if msg is None:
            self.queues[i].put(None)
            raise RuntimeError(f"gateway process {self.pids[i]} ended (exit {self.procs[i].wait()})")
        return msg

    def ask(self, cmd: str, event: str) -> list[dict[str, Any]]:
        """`cmd` to every process; each one's answer (other events, e.g. late
        `ready` lines, are skipped: the caller has read those it needed)."""
        self.send(cmd=cmd)
        out = []
        for i in range(len(self.procs)):
            while (msg := self.read(i)) is None or msg["event"] != event:
                pass
            out.append(msg)
        return out

    def log_summary(self) -> dict[str, Any]:
        """Warning lines the gateways logged, by logger, and the first of each."""
        seen: Counter[str] = Counter()
        first: dict[str, str] = {}
        for log in self.logs:
            with contextlib.suppress(OSError):
                for line in log.read_text(errors="replace").splitlines():
                    name = line.split(" ", 1)[0]
                    seen[name] += 1
                    first.setdefault(name, line[:300])
        return {"lines": dict(seen), "first": first}

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):  # a process already gone: killed below if need be
                assert p.stdin is not None
                p.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                p.stdin.flush()
        deadline = time.monotonic() + 60
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def admin_settings(nodes: list[str]) -> IggySettings:
    return IggySettings(
        kind="iggy",
        addresses=tuple(nodes) if len(nodes) > 1 else (),
        address=nodes[0],
        username=ROOT_USER,
        password=SecretStr(ROOT_PASSWORD),
        request_timeout_s=60.0,
        connect_timeout_s=60.0,
    )


def gateway_ids(n: int) -> list[str]:
    return [f"gw-{i:05d}" for i in range(n)]


def run_fleet(
    target: str,
    pids: list[int],
    nodes: list[str],
    args: argparse.Namespace,
    workdir: Path,
    restart: Callable[[], list[int]] | None = None,
    leader: str | None = None,
) -> None:
    n = args.gateways
    # The cloud side dials the leader first: a login on a follower is
    # verified there and again on the leader the SDK then moves to.
    admin = admin_settings(sorted(nodes, key=lambda a: a != leader))
    emit(
        BENCH,
        "server_rss_idle",
        round(max(rss_mb(p) for p in pids), 1),
        "MB",
        target=target,
        per_node=[round(rss_mb(p), 1) for p in pids],
    )
    # Provisioning, as the cloud side does it before a gateway starts: the
    # shared topics, each gateway's return-path topic and its user (and a
    # personal access token with --login token).
    t0 = time.perf_counter()
    creds = asyncio.run(
        provision(
            admin,
            gateway_ids(n),
            tokens=args.login == "token",
            at_once=args.provision_at_once,
            passes=args.provision == "passes",
        )
    )
    emit(
        BENCH,
        "provision_s",
        round(time.perf_counter() - t0, 2),
        "s",
        target=target,
        gateways=n,
        login=args.login,
    )
    rss = [rss_mb(p) for p in pids]
    emit(
        BENCH,
        "server_rss_after_provisioning",
        round(max(rss), 1),
        "MB",
        target=target,
        per_node=[round(x, 1) for x in rss],
    )
    if restart is not None:
        # A cluster restart on its data (--restart): it sheds what
        # provisioning one gateway at a time leaves on the leader, and it
        # moves some partitions' primaries (docs/scaling.md, run E).
        t0 = time.perf_counter()
        pids[:] = restart()
        emit(
            BENCH,
            "cluster_restart_s",
            round(time.perf_counter() - t0, 1),
            "s",
            target=target,
            rss_per_node=[round(rss_mb(p), 1) for p in pids],
        )
    per = -(-n // args.procs)
    cfgs = [
        {
            "workdir": str(workdir / target),
            "first": first,
            "count": min(per, n - first),
            "nodes": nodes,
            "creds": {k: v for k, v in creds.items() if first <= int(k[3:]) < first + per},
            "timeout_s": args.timeout,
            "heartbeat_s": args.heartbeat,
            "jitter_s": args.start_jitter,
            "poll_interval_s": args.poll_interval,
            "separate": args.separate,
        }
        for first in range(0, n, per)
    ]
    workers = Workers(cfgs)
    try:
        for i in range(len(workers.procs)):
            while (msg := workers.read(i)) is None or msg["event"] != "built":
                pass
        rss_before = [rss_mb(p) for p in pids]
        emit(
            BENCH,
            "server_rss_before",
            round(max(rss_before), 1),
            "MB",
            target=target,
            per_node=[round(x, 1) for x in rss_before],
            gateways=n,
        )

        # -- setup: every gateway at once --
        start_at = time.time() + 1.0
        cpu0 = [cpu_seconds(p) for p in pids]
        workers.send(cmd="go", at=start_at)
        ready: dict[str, float] = {}
        failed: set[str] = set()  # its start failed at least once (the agent's error metrics)
        timed_out: set[str] = set()  # ... of them, one whose failure was a timeout
        failures: Counter[str] = Counter()  # SDK calls that failed before their gateway was ready
        deadline = time.monotonic() + 1.0 + args.ready_timeout
        while len(ready) < n and time.monotonic() < deadline:
            for i in range(len(workers.procs)):
                while (msg := workers.read(i, timeout=0)) is not None:
                    if msg["event"] == "ready":
                        ready[msg["gw"]] = msg["at"] - start_at
                        if msg["errors"]:
                            failed.add(msg["gw"])
                        if any(k.endswith(": timed out") for k in msg["failures"]):
                            timed_out.add(msg["gw"])
                        failures.update(msg["failures"])
            time.sleep(0.05)
        setup_wall = time.time() - start_at
        cpu1 = [cpu_seconds(p) for p in pids]
        times = sorted(ready.values())
        not_ready = n - len(ready)
        emit(
            BENCH,
            "ready_s",
            round(times[-1], 2) if not_ready == 0 else None,
            "s",
            target=target,
            gateways=n,
            p50=round(pct(times, 0.5), 2),
            not_ready=not_ready,
            start_jitter_s=args.start_jitter,
            poll_interval_s=args.poll_interval,
            login=args.login,
            procs=args.procs,
            shared_connection=not args.separate,
        )
        if not_ready:
            stuck: dict[str, Any] = {}
            for ans in workers.ask("stuck", "stuck"):
                stuck.update(ans["stuck"])
            emit(
                BENCH,
                "not_ready_detail",
                len(stuck),
                "gateways",
                target=target,
                first=dict(list(stuck.items())[:5]),
            )
        emit(
            BENCH,
            "setup_timed_out",
            len(timed_out) + not_ready,
            "gateways",
            target=target,
            not_ready=not_ready,
            timeout_s=args.timeout,
            start_failed_then_retried=len(failed),
            failed_calls_before_ready=dict(failures.most_common(8)),
        )
        emit(
            BENCH,
            "setup_server_cpu",
            round(sum(cpu1) - sum(cpu0), 1),
            "cpu-s",
            target=target,
            per_node=[round(b - a, 1) for a, b in zip(cpu0, cpu1, strict=True)],
            seconds=round(setup_wall, 1),
        )
        rss = [rss_mb(p) for p in pids]
        emit(
            BENCH,
            "server_rss_after_setup_per_node",
            round(max(rss), 1),
            "MB",
            target=target,
            per_node=[round(x, 1) for x in rss],
            anonymous_per_node=[round(anon_mb(p), 1) for p in pids],
            topics=asyncio.run(topic_count(admin, "edge")),
            gateway_log_lines=workers.log_summary(),
        )

        # -- rest: no traffic --
        time.sleep(args.settle)
        before = workers.ask("counts", "counts")
        # Each count is divided by its own window: `ss` over a thousand
        # sockets and the workers' answers take a noticeable part of a
        # second, so the window of the sleep alone made a rate up to 2 %
        # high (1.020 at the SDK boundary, 1.004 by the sockets, for the one
        # poll a second each gateway makes).  `ss` is read at some instant
        # within its run: the midpoint of each run; the workers stamp their
        # counts (`at`, CLOCK_MONOTONIC, shared by the machine's processes).
        s0 = time.monotonic()
        _, segs0 = connections_and_requests(nodes)
        s0 = (s0 + time.monotonic()) / 2
        cpu0 = [cpu_seconds(p) for p in pids]
        t0 = time.monotonic()
        time.sleep(args.rest)
        elapsed = time.monotonic() - t0
        s1 = time.monotonic()
        conns1, segs1 = connections_and_requests(nodes)
        s1 = (s1 + time.monotonic()) / 2
        cpu1 = [cpu_seconds(p) for p in pids]
        after = workers.ask("counts", "counts")
        calls = Counter[str]()
        call_rate = 0.0
        for b, a in zip(before, after, strict=True):
            got = {k: v - b["calls"].get(k, 0) for k, v in a["calls"].items()}
            calls.update(got)
            call_rate += sum(got.values()) / (a["at"] - b["at"])
        window = sum(a["at"] - b["at"] for b, a in zip(before, after, strict=True)) / len(after)
        heartbeats = sum(a["heartbeats_per_s"] for a in after)
        sdk_rate = (call_rate + heartbeats) / n
        server_rate = (segs1 - segs0) / (s1 - s0) / n
        emit(
            BENCH,
            "requests_at_rest_per_gateway",
            round(server_rate, 3),
            "requests/s",
            target=target,
            gateways=n,
            seconds=round(s1 - s0, 1),
            counted_by="servers' sockets (data_segs_in)",
            sdk_boundary=round(sdk_rate, 3),
            sdk_calls_per_s={k: round(v / window, 1) for k, v in calls.items() if v},
            heartbeats_per_s=round(heartbeats, 1),
            errors=sum(a["errors"] for a in after) - sum(b["errors"] for b in before),
        )
        emit(
            BENCH,
            "connections_per_gateway",
            round(conns1 / n, 2),
            "connections",
            target=target,
            server_side=conns1,
            clients_connected=sum(a["connected"] for a in after),
        )
        emit(
            BENCH,
            "rest_cpu",
            round((sum(cpu1) - sum(cpu0)) / elapsed, 3),
            "cores (servers)",
            target=target,
            per_node=[round((b - a) / elapsed, 3) for a, b in zip(cpu0, cpu1, strict=True)],
            gateway_processes=round(
                (sum(a["cpu_s"] for a in after) - sum(b["cpu_s"] for b in before)) / elapsed, 2
            ),
        )

        # -- commands at rest --
        if args.commands:
            chosen = random.Random(7).sample(gateway_ids(n), min(args.commands, n))
            sent, took = asyncio.run(publish_commands(admin, chosen, args.command_every))
            time.sleep(args.command_wait)
            stored: dict[str, list[float]] = {}
            for ans in workers.ask("stored", "stored"):
                stored.update(ans["stored"])
            lat = []
            after_answer = []  # from the publish's answer on: the gateway's part
            for gw, at in sent.items():
                later = [t for t in stored.get(gw, []) if t >= at]
                if later:
                    lat.append((min(later) - at) * 1000)
                    after_answer.append((min(later) - at) * 1000 - took[gw])
            emit(
                BENCH,
                "command_latency_at_rest_p50",
                round(pct(lat, 0.5), 1),
                "ms",
                target=target,
                commands=len(chosen),
                published=len(sent),
                arrived=len(lat),
                every_s=args.command_every,
                # the cloud side's publish alone (start to the cluster's answer): part of the latency
                publish_ms_p50=round(pct(list(took.values()), 0.5), 1),
                publish_ms_p99=round(pct(list(took.values()), 0.99), 1),
                after_answer_ms_p50=round(pct(after_answer, 0.5), 1),
                after_answer_ms_p99=round(pct(after_answer, 0.99), 1),
            )
            emit(
                BENCH,
                "command_latency_at_rest_p99",
                round(pct(lat, 0.99), 1),
                "ms",
                target=target,
                max=round(max(lat, default=float("nan")), 1),
            )
        rss = [rss_mb(p) for p in pids]
        emit(
            BENCH,
            "server_rss_end_per_node",
            round(max(rss), 1),
            "MB",
            target=target,
            per_node=[round(x, 1) for x in rss],
            anonymous_per_node=[round(anon_mb(p), 1) for p in pids],
        )
    finally:
        workers.stop()


async def publish_commands(
    admin: IggySettings, gateways: list[str], every: float
) -> tuple[dict[str, float], dict[str, float]]:
    """One command to each gateway, `every` seconds apart; {gateway: sent at}
    for those the cluster took (a cluster that does not answer is counted,
    not fatal: the figures say how many arrived), and how long each of those
    publishes took (ms)."""
    sink = IggyCommandSink(admin)
    sent: dict[str, float] = {}
    took: dict[str, float] = {}
    try:
        for gw in gateways:
            at = time.time()
            with contextlib.suppress(UplinkError):
                await publish_command(sink, gw)
                sent[gw] = at
                took[gw] = (time.time() - at) * 1000
            await asyncio.sleep(every)
    finally:
        await sink.close()
    return sent, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateways", type=int, default=100)
    ap.add_argument("--procs", type=int, default=4, help="gateway processes")
    ap.add_argument("--only", choices=["single", "cluster"], default="cluster")
    ap.add_argument("--login", choices=["password", "token"], default="password")
    ap.add_argument("--separate", action="store_true", help="one connection each for uplink and return path")
    ap.add_argument("--start-jitter", type=float, default=0.0, help="iggy.start_jitter_s of every gateway")
    ap.add_argument("--heartbeat", type=float, default=60.0, help="iggy.heartbeat_interval_s (the default's)")
    ap.add_argument(
        "--poll-interval",
        type=float,
        default=1.0,
        help="downlink.poll_interval_s of every gateway (the default's; docs/scaling.md: the p99 trade-off)",
    )
    ap.add_argument("--timeout", type=float, default=30.0, help="connect/request timeout of the gateways")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--rest", type=float, default=30.0)
    ap.add_argument("--commands", type=int, default=60)
    ap.add_argument("--command-every", type=float, default=0.5)
    ap.add_argument("--command-wait", type=float, default=10.0)
    ap.add_argument(
        "--provision",
        choices=["passes", "each"],
        default="passes",
        help="passes: all topics, then all users, then all tokens (provision_gateways); "
        "each: one gateway after another, --provision-at-once at a time",
    )
    ap.add_argument(
        "--provision-at-once", type=int, default=4, help="with --provision each: gateways at a time"
    )
    ap.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="restart the cluster on its data after provisioning (default: no; docs/scaling.md, run E)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the servers' and gateways' files and logs")
    ap.add_argument("--quick", action="store_true", help="20 gateways, short phases (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.gateways, args.procs, args.settle, args.rest, args.commands = 20, 2, 4.0, 10.0, 10
    stop_on_signals()
    emit_machine(BENCH)
    if iggy_server_binary() is None:
        skipped(BENCH, "fleet", "iggy-server not on PATH (see tests/support/iggy_server.py to build it)")
        return
    workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    try:
        if args.only == "single":
            server = IggyServer(workdir / "iggy").start()
            try:
                assert server.proc is not None
                run_fleet("single", [server.proc.pid], [server.address], args, workdir)
            finally:
                server.stop()
        else:
            cluster = IggyCluster(workdir / "cluster").start()
            try:
                pids = [node.proc.pid for node in cluster.nodes if node.proc is not None]

                def restart() -> list[int]:
                    try:
                        cluster.restart()
                    except (TimeoutError, RuntimeError) as err:  # the error carries the node's log tail
                        raise SystemExit(
                            f"fleet: the cluster did not come back after its restart (--no-restart "
                            f"measures without one): {err}"
                        ) from None
                    return [node.proc.pid for node in cluster.nodes if node.proc is not None]

                run_fleet(
                    "cluster",
                    pids,
                    cluster.addresses,
                    args,
                    workdir,
                    restart if args.restart else None,
                    cluster.wait_leader(60),
                )
            finally:
                cluster.stop()
    finally:
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    load1, _, _ = os.getloadavg()
    emit(BENCH, "load_after", round(load1, 2), "loadavg_1m")


if __name__ == "__main__":
    main()
