"""The device library's heap after boot, as a board holds it: the library as
.mpy (what ``provision --mpy`` copies), imported, a ``Device`` made, connected
to a real Mosquitto, ``readings`` readings sent with receipts on (answered by
``ReceiptResponder``, what the agent's receipts do) until the ring is empty,
then gc'd: ``gc.mem_alloc()`` deltas.  umqtt.simple and the hardware
stand-ins are measured on their own and not counted in the library.

Prints one JSON line per mode (receipts on, receipts off):
  {"bench": "device_boot_heap", "receipts": true, "library_bytes": N, "code_bytes": N, ...}

Run: .venv32/bin/python bench/device_boot_heap.py [--readings 20] [--heapsize 96k] [--source]
(.venv32: the 32-bit float32 build, 4-byte words as on an ESP32; ``word_bytes``
says which ran.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.broker import Broker  # noqa: E402
from tests.support.micropython import Flash, ReceiptResponder, run_script  # noqa: E402

SNIPPET = r"""
import gc, json, sys, time
gc.collect(); base = gc.mem_alloc()
import machine, network
gc.collect(); stubs = gc.mem_alloc() - base
a = gc.mem_alloc()
from umqtt.simple import MQTTClient
gc.collect(); umqtt = gc.mem_alloc() - a
a = gc.mem_alloc()
from iggy_device import config
from iggy_device.node import Device
gc.collect(); code = gc.mem_alloc() - a
cfg = config.Config({"device_id": "DEV", "broker": "127.0.0.1", "port": PORT, "wifi_ssid": "x",
                     "period_ms": 0, "log": 0, "data_dir": "data", "receipts": RECEIPTS, "ntp": False})
dev = Device(cfg)
assert dev.connect()
for i in range(READINGS):
    dev.publish("env", {"temp_c": 21.5, "humidity_pct": 45.25, "pressure_pa": 101325.0})
    dev.poll()
ok = dev.flush(20000)
gc.collect(); lib = gc.mem_alloc() - a
print(json.dumps({"stubs": stubs, "umqtt": umqtt, "code": code, "lib": lib, "flushed": ok,
                  "sent": dev.stats["sent"], "mode": dev.diag()["receipt_mode"], "maxsize": sys.maxsize}))
"""


def measure(
    tmp: Path, port: int, receipts: bool, readings: int, heapsize: str, source: bool
) -> dict[str, Any]:
    dev = f"bootheap-{uuid.uuid4().hex[:8]}"
    flash = Flash(tmp / dev)
    flash.root.mkdir(parents=True)
    flash.install_library(mpy=not source)
    code = SNIPPET.replace("DEV", dev).replace("PORT", str(port)).replace("READINGS", str(readings))
    r = run_script(code.replace("RECEIPTS", str(receipts)), flash, heapsize=heapsize, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"the snippet failed:\n{(r.stdout + r.stderr)[-2000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        "bench": "device_boot_heap",
        "library": "source" if source else "mpy",
        "receipts": receipts,
        "receipt_mode": d["mode"],
        "readings": readings,
        "sent": d["sent"],
        "flushed": d["flushed"],
        "library_bytes": d["lib"],  # code + Device state, after boot, connect and the readings
        "code_bytes": d["code"],  # the imports alone
        "umqtt_bytes": d["umqtt"],
        "stubs_bytes": d["stubs"],
        "word_bytes": 4 if d["maxsize"] < 2**32 else 8,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readings", type=int, default=20)
    ap.add_argument("--heapsize", default="96k")
    ap.add_argument("--source", action="store_true", help="the library as .py (compiled on the board)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="iggy-boot-heap-") as t:
        tmp = Path(t)
        broker = Broker(tmp / "broker").start()
        responder = ReceiptResponder(broker)
        try:
            for receipts in (True, False):
                row = measure(tmp, broker.port, receipts, args.readings, args.heapsize, args.source)
                print(json.dumps(row), flush=True)
        finally:
            responder.close()
            broker.stop()


if __name__ == "__main__":
    main()
