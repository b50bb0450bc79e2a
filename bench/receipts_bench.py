"""Delivery receipts (agent/iggy_edge/receipts.py): what they cost a device.

A fresh Mosquitto (in memory), the agent as ``iggy-edge run`` in its own
process (committed mode, ``min_interval_ms`` 200, no uplink), and a fleet of
simulated devices in this process: each publishes QoS1 readings with a device
``"seq"`` at a fixed rate and subscribes to its receipt topic, as the device
library does.  Per rate (1, 10, 100 readings/s per device):

* ``downlink_per_device_s``: receipts a device receives per second (the
  extra downlink messages; the reading rate is printed beside it);
* ``latency_p50_ms`` / ``latency_p99_ms``: from a reading's publish to the
  first receipt that covers it (what a reading waits in the ring on top of
  today's PUBACK);
* ``held_mean`` / ``held_max``: readings a device holds for a receipt,
  sampled every 10 ms (the added ring occupancy; ``held_bytes_max`` with the
  library's ring line size for these readings).

    .venv/bin/python bench/receipts_bench.py [--quick] [--devices N] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gmqtt
from _common import broker as make_broker
from _common import emit, emit_machine
from gmqtt.mqtt.constants import MQTTv311

BENCH = "receipts"
AGENT = str(Path(sys.executable).with_name("iggy-edge"))


class _Dev:
    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: dict[int, float] = {}
        self.seq = -1
        self.covered = -1
        self.receipts = 0
        self.latencies: list[float] = []
        self.line_bytes = 0

    def on_receipt(self, seq: int) -> None:
        now = time.perf_counter()
        self.receipts += 1
        for s in range(self.covered + 1, seq + 1):
            t = self.sent.pop(s, None)
            if t is not None:
                self.latencies.append(now - t)
        self.covered = max(self.covered, seq)


async def _fleet(port: int, devices: int, rate: float, seconds: float, tag: str) -> dict[str, Any]:
    devs = [_Dev(f"rb-{tag}-{i}") for i in range(devices)]
    all_covered = asyncio.Event()
    stop = float("inf")  # set when publishing starts
    clients = []
    for d in devs:

        def on_message(client: Any, topic: str, payload: bytes, qos: int, props: Any, d: _Dev = d) -> int:
            doc = json.loads(payload)
            if doc.get("seq", -1) >= 0:
                d.on_receipt(int(doc["seq"]))
                if time.perf_counter() >= stop and all(x.covered >= x.seq for x in devs):
                    all_covered.set()
            return 0

        c = gmqtt.Client(f"{d.name}-c", clean_session=True)
        c.on_message = on_message
        await c.connect("127.0.0.1", port, version=MQTTv311)
        c.subscribe(f"edge/{d.name}/down/receipt", qos=0)
        clients.append(c)
    await asyncio.sleep(0.5)
    stop = time.perf_counter() + seconds
    held: list[int] = []

    async def publisher(d: _Dev, c: gmqtt.Client) -> None:
        period = 1 / rate
        nxt = time.perf_counter()
        while nxt < stop:
            d.seq += 1
            payload = json.dumps({"seq": d.seq, "ts": int(time.time()), "temp_c": 21.5}).encode()
            d.line_bytes = len(payload) + len("env ") + 1
            d.sent[d.seq] = time.perf_counter()
            c.publish(f"edge/{d.name}/up/env", payload, qos=1)
            nxt += period
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

    async def sampler() -> None:
        while time.perf_counter() < stop:
            held.extend(d.seq - d.covered for d in devs)
            await asyncio.sleep(0.01)

    await asyncio.gather(*(publisher(d, c) for d, c in zip(devs, clients, strict=True)), sampler())
    if any(d.covered < d.seq for d in devs):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_covered.wait(), 5)
    for c in clients:
        await c.disconnect()
    lat = sorted(x for d in devs for x in d.latencies)
    published = sum(d.seq + 1 for d in devs)
    return {
        "published": published,
        "uncovered": sum(d.seq - d.covered for d in devs),
        "receipts_per_device_s": sum(d.receipts for d in devs) / devices / seconds,
        "p50_ms": 1000 * statistics.median(lat) if lat else None,
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "held_mean": statistics.fmean(held) if held else 0.0,
        "held_max": max(held) if held else 0,
        "line_bytes": max(d.line_bytes for d in devs),
    }


def _agent(workdir: Path, port: int) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = workdir / "agent.toml"
    cfg.write_text(
        f'gateway_id = "bench"\nstate_dir = "{workdir / "state"}"\n'
        f'[mqtt]\nport = {port}\n[iggy]\nkind = "none"\n[downlink]\nenabled = false\n'
        "[metrics]\nenabled = false\n[receipts]\nmin_interval_ms = 200\n"
    )
    log = workdir / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([AGENT, "run", "-c", str(cfg)], stdout=out, stderr=out)
    deadline = time.monotonic() + 30
    while "MQTT session up" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("agent did not start:\n" + log.read_text(errors="replace")[-2000:])
        time.sleep(0.05)
    time.sleep(0.3)  # its SUBSCRIBE lands
    return proc, log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rates", default="1,10,100")
    a = ap.parse_args()
    seconds = 2.0 if a.quick else a.seconds
    devices = 3 if a.quick else a.devices
    emit_machine(BENCH)
    with tempfile.TemporaryDirectory(prefix="iggy-edge-rbench-") as tmp, make_broker(Path(tmp)) as broker:
        proc, _log = _agent(Path(tmp), broker.port)
        try:
            for rate_s in a.rates.split(","):
                rate = float(rate_s)
                r = asyncio.run(_fleet(broker.port, devices, rate, seconds, f"{int(rate)}-{os.getpid()}"))
                common = {"readings_per_device_s": rate, "devices": devices, "seconds": seconds}
                emit(BENCH, "downlink_per_device_s", round(r["receipts_per_device_s"], 2), "msg/s", **common)
                emit(BENCH, "latency_p50_ms", r["p50_ms"] and round(r["p50_ms"], 1), "ms", **common)
                emit(BENCH, "latency_p99_ms", r["p99_ms"] and round(r["p99_ms"], 1), "ms", **common)
                emit(
                    BENCH,
                    "held_readings",
                    round(r["held_mean"], 2),
                    "readings",
                    max=r["held_max"],
                    held_bytes_max=r["held_max"] * r["line_bytes"],
                    line_bytes=r["line_bytes"],
                    published=r["published"],
                    uncovered_at_end=r["uncovered"],
                    **common,
                )
        finally:
            proc.terminate()
            proc.wait(20)
    load1, _, _ = os.getloadavg()
    emit(BENCH, "loadavg_after", round(load1, 2), "")


if __name__ == "__main__":
    main()
