"""What a login costs the Iggy server: password against personal access token.

A real iggy-server (one node, or the 3-node cluster with ``--cluster``),
logins made through the agent's own `Connection` (connect + log in, as a
gateway does on start and on every reconnect):

sequential  ``--count`` logins one after the other, per kind: wall time per
            login (p50 / p90) and the server's CPU time per login (its
            /proc/<pid>/stat over the run, divided by the count).
together    ``--together`` logins started at the same instant, per kind:
            the time until the last one is in (a fleet starting together,
            or reconnecting after a restart), and how many failed within
            the 30 s connect timeout.

The server hashes a password with Argon2 (server_common/src/crypto.rs,
``Argon2::default()``) on its shard thread; a token is hashed once with a
plain hash and looked up (server/src/auth.rs).

    flock /work/bench.lock .venv/bin/python bench/login_cost_bench.py [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import emit, emit_machine, skipped
from _fleet_server import cpu_seconds, create_token, pct, rss_mb
from iggy_edge.config import IggySettings
from iggy_edge.uplink.iggy.connection import Connection
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

BENCH = "login_cost"


def settings(nodes: list[str], token: str | None) -> IggySettings:
    return IggySettings(
        kind="iggy",
        address=nodes[0],
        addresses=tuple(nodes) if len(nodes) > 1 else (),
        username=ROOT_USER,
        password=None if token else SecretStr(ROOT_PASSWORD),
        token=SecretStr(token) if token else None,
        connect_timeout_s=30.0,
        request_timeout_s=30.0,
    )


async def one_login(s: IggySettings) -> float:
    conn = Connection(s, "login bench")
    t0 = time.perf_counter()
    try:
        await conn.client()
        return time.perf_counter() - t0
    finally:
        await conn.close()


async def together(s: IggySettings, n: int) -> tuple[float, int]:
    conns = [Connection(s, f"login bench {i}") for i in range(n)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(c.client() for c in conns), return_exceptions=True)
    wall = time.perf_counter() - t0
    failed = sum(isinstance(r, UplinkError) for r in results)
    for c in conns:
        await c.close()
    return wall, failed


def measure(target: str, pids: list[int], nodes: list[str], args: argparse.Namespace) -> None:
    admin = settings(nodes, None)
    token = asyncio.run(create_token(admin, "login-bench"))
    for kind, s in (("password", admin), ("token", settings(nodes, token))):
        asyncio.run(one_login(s))  # warm: the first login pays for the leader look-up
        cpu0 = sum(cpu_seconds(p) for p in pids)

        async def seq(s: IggySettings = s) -> list[float]:
            return [await one_login(s) for _ in range(args.count)]

        walls = asyncio.run(seq())
        cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) / args.count
        emit(
            BENCH,
            f"{kind}_login_ms",
            round(pct(walls, 0.5) * 1000, 1),
            "ms",
            target=target,
            p90=round(pct(walls, 0.9) * 1000, 1),
            server_cpu_ms_per_login=round(cpu * 1000, 2),
            logins=args.count,
        )
        cpu0 = sum(cpu_seconds(p) for p in pids)
        rss0 = max(rss_mb(p) for p in pids)
        wall, failed = asyncio.run(together(s, args.together))
        emit(
            BENCH,
            f"{kind}_logins_together_s",
            round(wall, 2),
            "s",
            target=target,
            logins=args.together,
            failed=failed,
            server_cpu_s=round(sum(cpu_seconds(p) for p in pids) - cpu0, 2),
            server_rss_mb_before=round(rss0, 1),
            server_rss_mb_after=round(max(rss_mb(p) for p in pids), 1),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--together", type=int, default=300)
    ap.add_argument("--cluster", action="store_true")
    args = ap.parse_args()
    stop_on_signals()
    emit_machine(BENCH)
    if iggy_server_binary() is None:
        skipped(BENCH, "login", "iggy-server not on PATH")
        return
    workdir = Path(tempfile.mkdtemp(prefix="login-bench-"))
    try:
        if args.cluster:
            cluster = IggyCluster(workdir / "cluster").start()
            try:
                pids = [n.proc.pid for n in cluster.nodes if n.proc is not None]
                measure("cluster", pids, cluster.addresses, args)
            finally:
                cluster.stop()
        else:
            server = IggyServer(workdir / "iggy").start()
            try:
                assert server.proc is not None
                measure("single", [server.proc.pid], [server.address], args)
            finally:
                server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
