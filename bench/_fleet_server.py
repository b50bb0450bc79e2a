"""The cloud side and the servers' figures for bench/fleet_bench.py: the
gateways provisioned (cloud/provision.py, and a personal access token each),
commands published, and what the nodes use (RSS, CPU, connections and
requests by their sockets)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iggy_edge.cloud.provision import Provisioned, provision_gateway, provision_gateways
from iggy_edge.config import IggySettings, parse_config
from iggy_edge.downlink.commands import make_command, return_topic_of
from iggy_edge.uplink.iggy import IggyCommandSink, IggyProbe
from iggy_edge.uplink.iggy.connection import Connection, create_personal_access_token
from iggy_edge.uplink.protocol import UplinkError


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


def anon_mb(pid: int) -> float:
    """Anonymous (heap) part of the RSS, /proc/<pid>/smaps_rollup; the rest
    is file pages mapped (the binary, segment and index files)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU time of a process (/proc/<pid>/stat), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def connections_and_requests(nodes: Sequence[str]) -> tuple[int, int]:
    """(established client connections of the nodes, the data segments
    their sockets have received in all): ``ss -ti`` on the nodes' client
    ports.  The SDK writes each request in one flush and waits for its
    answer before the next, so a received data segment is a request
    (heartbeats included)."""
    ports = " or ".join(f"sport = :{a.rsplit(':', 1)[1]}" for a in nodes)
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( {ports} )"], capture_output=True, text=True, check=True
    ).stdout
    conns = segs = 0
    for line in out.splitlines():
        if line[:1].isspace() or "data_segs_in" in line or "rtt:" in line:
            for part in line.split():
                if part.startswith("data_segs_in:"):
                    segs += int(part.split(":", 1)[1])
        else:
            conns += 1
    return conns, segs


def gateway_settings(gateway: str, iggy: IggySettings | None = None) -> Any:
    """The default settings of `gateway` (naming, routes), with `iggy` if given."""
    s = parse_config({"gateway_id": gateway, "metrics": {"enabled": False}}, env={})
    return s if iggy is None else s.model_copy(update={"iggy": iggy})


async def provision(
    admin: IggySettings, gateways: Sequence[str], *, tokens: bool, at_once: int = 4, passes: bool = True
) -> dict[str, dict[str, str]]:
    """Every gateway provisioned as the cloud side does it: the shared route
    topics, the gateway's return-path topic, its user allowed only those, and
    with `tokens` its personal access token.  With `passes` (the default) in
    one `provision_gateways` call, all topics, then all users, then all
    tokens, on one admin connection; without, `provision_gateway` for one
    gateway after another, `at_once` at a time (what running
    `iggy-edge cloud provision-gateway` once per gateway does to the server:
    docs/scaling.md, "Provisioning").  The gateways' credentials:
    {gateway: {"username", "token" or "password"}}."""
    creds: dict[str, dict[str, str]] = {}

    def keep(done: Provisioned) -> None:
        assert done.password is not None
        secret = {"token": done.token} if done.token is not None else {"password": done.password}
        creds[done.gateway_id] = {"username": done.username, **secret}

    if passes:
        conn = Connection(admin, "provisioning")
        try:
            for done in await provision_gateways(
                gateway_settings(gateways[0], admin), gateways, tokens=tokens, connection=conn
            ):
                keep(done)
        finally:
            await conn.close()
        return creds
    todo: asyncio.Queue[str] = asyncio.Queue()
    for gw in gateways:
        todo.put_nowait(gw)

    async def work() -> None:
        conn = Connection(admin, "provisioning")  # one admin login per worker, not per gateway
        try:
            while not todo.empty():
                gw = todo.get_nowait()
                keep(await provision_gateway(gateway_settings(gw, admin), gw, tokens=tokens, connection=conn))
        finally:
            await conn.close()

    await asyncio.gather(*(work() for _ in range(at_once)))
    return creds


async def create_token(user: IggySettings, name: str) -> str:
    """A personal access token of `user`, no expiry."""
    conn = Connection(user, "token")
    try:
        return await create_personal_access_token(conn, name)
    finally:
        await conn.close()


async def publish_command(sink: IggyCommandSink, gateway: str) -> None:
    """One command to the gateway's first device, as `command send` does
    (its return-path topic, the kind header)."""
    s = gateway_settings(gateway)
    rt = return_topic_of(gateway, s.downlink)
    cmd = make_command(f"{gateway}-dev0", "ping")
    await sink.publish(rt.stream, rt.topic, rt.partition, cmd.wire(), cmd.headers())


async def topic_count(admin: IggySettings, stream: str) -> int | None:
    """Topics in `stream` (None when the cluster does not answer)."""
    try:
        async with IggyProbe(admin, timeout_s=60.0) as probe:
            details = await probe.stream(stream)
    except UplinkError:
        return None
    return 0 if details is None else int(details.topics_count)
