"""Floods: peak RSS of the agent process while a publisher floods it
(issue 8 item 6; target: under 120 MB in every flood).

Each flood runs against a fresh `iggy-edge run` (the real command, its own
process, uplink ``none`` so records stay in the buffer) and a fresh Mosquitto
(in memory, configured like the shipped snippet).  A raw-socket publisher
(bench/_publisher's approach, the agent's codec) sends the flood as fast as
the broker takes it: QoS0 with nothing to wait for, QoS1 with a window of
2,000 unacknowledged.  When the agent has taken every message (its /metrics:
messages received, or no change for 5 s), VmHWM -- the kernel's peak
resident set of the agent -- and VmRSS (what stays after the flood) are read.

Floods (payload sizes against the default buffer.max_payload_bytes, 256 KiB):

* ``empty_qos0``: 50,000 empty QoS0 payloads (dead letters, "empty_payload")
* ``oversize_qos0``: 800 QoS0 payloads of 258 KiB (dead letters, "oversize";
  still under the shipped broker's max_packet_size, 260 KiB)
* ``large_qos1``: 1,500 QoS1 payloads of 256 KiB (receive maximum x max payload)
* ``large_qos0``: 2,000 QoS0 payloads of 256 KiB (the QoS0 queue bound of
  20,000 records alone would admit 5 GB)
* ``topics_qos1``: 100,000 QoS1 readings of 60 bytes from one device, each on
  a topic of its own (issue 18 item 5: every distinct topic was a source row
  and two cache entries, kept until the buffer emptied and loaded at start);
  also the idle RSS of a fresh agent started on the same buffer afterwards

Prints one JSON line per flood.

    .venv/bin/python bench/flood_bench.py [--floods a,b] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import broker as make_broker
from _common import emit, emit_machine, free_port, vm_hwm_kb, vm_rss_kb
from iggy_edge import mqtt_codec as codec
from memory_bench import iggy_edge_cmd

BENCH = "flood"
TARGET_MB = 120
KIB = 1024
# name -> (count, payload bytes, qos)
FLOODS: dict[str, tuple[int, int, int]] = {
    "empty_qos0": (50_000, 0, 0),
    "oversize_qos0": (800, 258 * KIB, 0),
    "large_qos1": (1_500, 256 * KIB, 1),
    "large_qos0": (2_000, 256 * KIB, 0),
    "topics_qos1": (100_000, 60, 1),
}
# floods whose every message has a topic of its own (one device)
DISTINCT_TOPICS = frozenset({"topics_qos1"})


def write_config(state: Path, port: int, metrics_port: int) -> Path:
    conf = state / "config.toml"
    conf.write_text(
        f"""\
gateway_id = "flood"
state_dir = "{state}"

[mqtt]
port = {port}
client_id = "iggy-edge-flood"

[iggy]
kind = "none"

[buffer]
max_bytes = 4_000_000_000
max_records = 10_000_000

[downlink]
enabled = false

[metrics]
listen = "127.0.0.1:{metrics_port}"

[logging]
level = "WARNING"
"""
    )
    return conf


def rss_parts_mb(pid: int) -> dict[str, float]:
    """RssAnon / RssFile / RssShmem: what stays after a flood, by kind."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
            key, kb = line.split()[:2]
            out[key.rstrip(":").lower()[3:] + "_after_mb"] = round(int(kb) / 1024, 1)
    return out


def scrape(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("iggy_edge_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _sum(m: dict[str, float], prefix: str) -> int:
    return int(sum(v for k, v in m.items() if k.startswith(prefix)))


def received(m: dict[str, float]) -> int:
    return _sum(m, "iggy_edge_ingest_messages_total")


def settled(m: dict[str, float]) -> int:
    """Messages the agent is done with: committed, dead-lettered or dropped."""
    return (
        int(m.get("iggy_edge_store_records_committed_total", 0))
        + _sum(m, "iggy_edge_store_dead_letters_total")
        + _sum(m, "iggy_edge_store_dropped_records_total")
    )


async def publish(port: int, count: int, size: int, qos: int, *, distinct: bool = False) -> float:
    """Send the flood; for QoS1 wait for every PUBACK.  Returns seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.write(codec.connect(f"flood-pub-{time.monotonic_ns()}"))
    await reader.readexactly(4)
    window = asyncio.Semaphore(2000)
    acked = 0
    done = asyncio.Event()

    async def read_acks() -> None:
        nonlocal acked
        splitter = codec.Splitter()
        while chunk := await reader.read(65536):
            for first, _ in splitter.feed(chunk):
                if first & 0xF0 == codec.PUBACK:
                    acked += 1
                    window.release()
                    if acked == count:
                        done.set()

    acks = asyncio.create_task(read_acks())
    payload = b"x" * size
    started = time.perf_counter()
    for i in range(count):
        if qos:
            await window.acquire()
        topic = f"edge/dev0/up/t{i}" if distinct else f"edge/dev{i % 10}/up/env"
        writer.write(codec.publish(topic, payload, qos=qos, mid=i % 65535 + 1))
        await writer.drain()
    if qos:
        await asyncio.wait_for(done.wait(), 600)
    writer.write(codec.PINGREQ_PACKET)
    await writer.drain()
    seconds = time.perf_counter() - started
    writer.write(codec.DISCONNECT_PACKET)
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    acks.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConnectionError):
        await acks
    return seconds


def run_flood(workdir: Path, name: str, scale: float = 1.0) -> dict[str, Any]:
    count, size, qos = FLOODS[name]
    count = max(1, int(count * scale))
    state = workdir / "state"
    state.mkdir(parents=True)
    metrics_port = free_port()
    with make_broker(workdir / "broker") as broker:
        conf = write_config(state, broker.port, metrics_port)
        log = (workdir / "agent.log").open("wb")
        agent = subprocess.Popen([*iggy_edge_cmd(), "run", "--config", str(conf)], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 30
            while True:  # up and subscribed: the connected gauge is 1
                if agent.poll() is not None:
                    raise RuntimeError(f"agent exited: {(workdir / 'agent.log').read_text()[-2000:]}")
                with contextlib.suppress(OSError):
                    if scrape(metrics_port).get("iggy_edge_ingest_connected") == 1:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("agent did not connect")
                time.sleep(0.2)
            time.sleep(0.5)  # the SUBACK
            rss_start = vm_rss_kb(agent.pid)
            seconds = asyncio.run(publish(broker.port, count, size, qos, distinct=name in DISTINCT_TOPICS))
            last, still = -1, time.monotonic()
            while True:
                got = settled(scrape(metrics_port))
                if got >= count:
                    break
                if got != last:
                    last, still = got, time.monotonic()
                elif time.monotonic() - still > 5:
                    break
                time.sleep(0.2)
            time.sleep(2.0)  # the last commits; then what stays
            m = scrape(metrics_port)
            hwm, rss = vm_hwm_kb(agent.pid), vm_rss_kb(agent.pid)
            parts = rss_parts_mb(agent.pid)
        finally:
            stop_agent(agent)
            log.close()
        restarted = (
            idle_rss_after_restart_mb(workdir, conf, metrics_port) if name in DISTINCT_TOPICS else None
        )
    return {
        "idle_rss_after_restart_mb": restarted,
        "peak_rss_mb": round(hwm / 1024, 1),
        "rss_after_mb": round(rss / 1024, 1),
        "rss_start_mb": round(rss_start / 1024, 1),
        **parts,
        "count": count,
        "payload_bytes": size,
        "qos": qos,
        "received": received(m),
        "committed": int(m.get("iggy_edge_store_records_committed_total", 0)),
        "dead_letters": _sum(m, "iggy_edge_store_dead_letters_total"),
        "dropped": {
            k.split('reason="')[1].rstrip('"}'): int(v)
            for k, v in m.items()
            if k.startswith("iggy_edge_store_dropped_records_total") and v
        },
        "read_pauses": int(m.get("iggy_edge_ingest_read_pauses_total", 0)),
        "publish_seconds": round(seconds, 2),
        "agent_exit": agent.returncode,
    }


def stop_agent(agent: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as systemd stops it; SIGKILL after 60 s."""
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(timeout=60)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def idle_rss_after_restart_mb(workdir: Path, conf: Path, metrics_port: int) -> float:
    """A fresh agent on the flooded buffer, once connected and idle for 3 s."""
    with (workdir / "agent-restart.log").open("wb") as log:
        agent = subprocess.Popen([*iggy_edge_cmd(), "run", "--config", str(conf)], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(OSError):
                    if scrape(metrics_port).get("iggy_edge_ingest_connected") == 1:
                        break
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the restarted agent did not connect")
                time.sleep(0.2)
            time.sleep(3.0)
            return round(vm_rss_kb(agent.pid) / 1024, 1)
        finally:
            stop_agent(agent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--floods", default=",".join(FLOODS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every flood's message count")
    ap.add_argument("--quick", action="store_true", help="tiny floods (smoke test)")
    a = ap.parse_args()
    if a.quick:
        a.scale = 0.02
    emit_machine(BENCH)
    for name in a.floods.split(","):
        with tempfile.TemporaryDirectory(prefix="iggy-edge-flood-") as tmp:
            res = run_flood(Path(tmp), name, a.scale)
        emit(BENCH, f"{name}_peak_rss", res.pop("peak_rss_mb"), "MB", target=TARGET_MB, **res)


if __name__ == "__main__":
    main()
