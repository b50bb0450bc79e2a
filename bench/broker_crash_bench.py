"""Mosquitto's autosave: messages lost in a broker crash against the cost of
saving, per setting, on this machine.

A persistent session like the agent's (fixed client id, clean start off,
session expiry 1 h, subscribed to ``edge/+/up/#`` at QoS1) is registered and
saved (orderly restart), then goes offline, as when the agent is stopped or
restarting.  A publisher sends QoS1 at ``--rate`` msg/s (60-byte JSON with a
sequence number) and counts the broker's PUBACKs: each one is a message the
broker took responsibility for.

* loss: after a random time (uniform in ``--kill-after``) Mosquitto is
  SIGKILLed, restarted on the same files, and the session is drained; lost =
  acknowledged to the publisher but never delivered to the session.
* cost: a steady ``--cost-seconds`` run without a crash; Mosquitto's CPU
  seconds (/proc/<pid>/stat) and bytes written (/proc/<pid>/io: ``wchar``,
  what it handed to write(); ``write_bytes``, what reached the block device).

Mosquitto writes its whole in-memory store at every save, so the cost grows
with the queue held for the offline session.

    .venv/bin/python bench/broker_crash_bench.py [--quick] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gmqtt
from _common import Broker, emit, emit_machine
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge import mqtt_codec as codec

BENCH = "broker_crash"
SESSION = "iggy-edge-bench-session"
SETTINGS: dict[str, str] = {
    "interval_1800": "autosave_interval 1800",  # Mosquitto's default
    "interval_60": "autosave_interval 60",  # shipped before this measurement
    "interval_10": "autosave_interval 10",
    "interval_1": "autosave_interval 1",
    "changes_1000": "autosave_interval 1000\nautosave_on_changes true",
    "changes_100": "autosave_interval 100\nautosave_on_changes true",
}


def make_broker(workdir: Path, setting: str) -> Broker:
    lines = SETTINGS[setting].splitlines()
    interval = int(lines[0].split()[1])
    return Broker(workdir, autosave_interval=interval, extra_conf="\n".join(lines[1:]))


async def session(port: int, *, drain_quiet_s: float = 0.0) -> set[int]:
    """Connect as the persistent session; with drain_quiet_s, collect the
    sequence numbers delivered until nothing arrives for that long."""
    got: set[int] = set()
    last = time.monotonic()

    def on_message(client: Any, topic: str, payload: bytes, qos: int, props: Any) -> int:
        nonlocal last
        got.add(int(payload.split(b'"seq":')[1].split(b",")[0]))
        last = time.monotonic()
        return 0

    client = gmqtt.Client(SESSION, clean_session=False, session_expiry_interval=3600)
    client.on_message = on_message
    await client.connect("127.0.0.1", port, version=MQTTv50)
    client.subscribe("edge/+/up/#", qos=1)
    while drain_quiet_s and time.monotonic() - last < drain_quiet_s:  # noqa: ASYNC110 - quiet time is the signal
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    await client.disconnect()
    return got


class Publisher:
    """QoS1 at a steady rate; `acked` holds the sequence numbers the broker acknowledged."""

    def __init__(self) -> None:
        self.acked: set[int] = set()
        self.sent = 0
        self._mids: dict[int, int] = {}

    async def run(self, port: int, rate: float, stop: asyncio.Event) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(codec.connect(f"bench-crash-pub-{time.monotonic_ns()}"))
        reading = asyncio.create_task(self._read(reader))
        started = time.monotonic()
        try:
            while not stop.is_set():
                due = int((time.monotonic() - started) * rate) - self.sent
                out = []
                for _ in range(max(due, 0)):
                    self.sent += 1
                    mid = self.sent % 65535 + 1
                    self._mids[mid] = self.sent
                    body = b'{"seq":%d,"t":21.5,"rh":40.1,"pad":"xxxxxxxxxxxxxxxxxxxxxxx"}' % self.sent
                    out.append(codec.publish(f"edge/dev{self.sent % 10}/up/env", body, qos=1, mid=mid))
                if out:
                    writer.write(b"".join(out))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.01)
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await reading
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        splitter = codec.Splitter()
        while chunk := await reader.read(65536):
            for first, body in splitter.feed(chunk):
                if first & 0xF0 == codec.PUBACK:
                    mid, _ = codec.parse_ack(body)
                    if mid in self._mids:
                        self.acked.add(self._mids.pop(mid))


def proc_figures(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, wchar, write_bytes) of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return cpu, int(io["wchar"]), int(io["write_bytes"])


async def prepare(broker: Broker) -> None:
    broker.start()
    await session(broker.port)  # registers the session and its subscription
    broker.restart()  # SIGTERM saves: the session is on disk, as on a gateway that ran a while


async def loss_trial(workdir: Path, setting: str, rate: float, kill_after: float) -> dict[str, Any]:
    broker = make_broker(workdir, setting)
    await prepare(broker)
    pub = Publisher()
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(broker.port, rate, stop))
    await asyncio.sleep(kill_after)
    broker.kill()
    stop.set()
    with contextlib.suppress(ConnectionError, OSError):
        await task
    broker.start()
    try:
        delivered = await session(broker.port, drain_quiet_s=2.0)
    finally:
        broker.stop()
    lost = len(pub.acked - delivered)
    return {"acked": len(pub.acked), "lost": lost, "kill_after_s": round(kill_after, 2)}


async def cost_run(workdir: Path, setting: str, rate: float, seconds: float) -> dict[str, Any]:
    broker = make_broker(workdir, setting)
    await prepare(broker)
    assert broker.proc is not None
    before = proc_figures(broker.proc.pid)
    pub = Publisher()
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(broker.port, rate, stop))
    await asyncio.sleep(seconds)
    after = proc_figures(broker.proc.pid)
    stop.set()
    await task
    broker.stop()
    return {
        "cpu_s": round(after[0] - before[0], 2),
        "wchar_mb": round((after[1] - before[1]) / 1e6, 1),
        "disk_mb": round((after[2] - before[2]) / 1e6, 1),
        "acked": len(pub.acked),
    }


async def main_async(a: argparse.Namespace) -> None:
    rnd = random.Random(a.seed)
    lo, hi = (float(x) for x in a.kill_after.split(","))
    for setting in a.settings.split(","):
        losses = []
        for t in range(a.trials):
            with tempfile.TemporaryDirectory(prefix="crash-bench-") as tmp:
                losses.append(await loss_trial(Path(tmp) / f"b{t}", setting, a.rate, rnd.uniform(lo, hi)))
        with tempfile.TemporaryDirectory(prefix="crash-bench-") as tmp:
            cost = await cost_run(Path(tmp) / "cost", setting, a.rate, a.cost_seconds)
        lost = [x["lost"] for x in losses]
        emit(
            BENCH,
            f"{setting}_lost",
            statistics.median(lost),
            "messages",
            config=SETTINGS[setting].replace("\n", "; "),
            rate=a.rate,
            trials=losses,
            max=max(lost),
        )
        emit(
            BENCH,
            f"{setting}_cost",
            round(cost["cpu_s"] / a.cost_seconds, 3),
            "broker CPU s/s",
            config=SETTINGS[setting].replace("\n", "; "),
            rate=a.rate,
            seconds=a.cost_seconds,
            written_mb_per_s=round(cost["wchar_mb"] / a.cost_seconds, 2),
            disk_mb_per_s=round(cost["disk_mb"] / a.cost_seconds, 2),
            **cost,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two settings, one short trial each (smoke test)")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--kill-after", default="3,12", help="SIGKILL after uniform(lo,hi) seconds")
    ap.add_argument("--cost-seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=8)
    a = ap.parse_args()
    if a.quick:
        a.settings, a.trials, a.kill_after, a.cost_seconds = "interval_1,changes_1000", 1, "1,2", 2.0
    emit_machine(BENCH)
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
