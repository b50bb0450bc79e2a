"""Smallest MicroPython heap that runs the env_sensor example with the
library (and umqtt) as .mpy, as a board would run it: the real Unix port,
the real umqtt.simple, a real Mosquitto, ``cycles`` readings published with
receipts on (the default), answered by a receipt responder on the broker
(tests/support/micropython.py ``ReceiptResponder``, what the agent's
receipts do), so readings flow and leave the ring as on a gateway.  A probe
passes only when every reading was sent (``sent`` >= ``cycles``) and the
device ran with receipts on.

Prints one JSON line per probe and a summary line:
  {"bench": "device_min_heap", "smallest_ok_k": N, "largest_failing_k": N-step, "sent": n, ...}

``--layout ota``: the same app in the layout provisioning writes for
over-the-air updates (agent/iggy_edge/provision/layout.py: /main.py the
loader, the app in slot s/a/, ota.json), so the OTA figures of
bench/ota_device_bench.py compare with a figure of this same tool.

``--frozen``: on a firmware with the library and umqtt frozen in
(tests/support/frozen.py builds the 32-bit float32 port with device/manifest.py
from a MicroPython checkout; device/README.md), nothing of them on the flash.

Run: .venv/bin/python bench/device_min_heap.py [--cycles 300] [--lo 32] [--hi 160] [--step 4] [--source]
     [--layout plain|ota] [--frozen]
On the 32-bit float32 build (4-byte words, as an ESP32): the same with
.venv32/bin/python (made by .ci/setup when ../shared/tools/micropython-i386-float32
exists; its bin/micropython is that build).  ``word_bytes`` says which ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import frozen  # noqa: E402
from tests.support.broker import Broker  # noqa: E402
from tests.support.micropython import Board, Flash, ReceiptResponder, word_bytes  # noqa: E402
from tests.support.ota_sender import slot_layout  # noqa: E402


def runs(
    tmp: Path,
    port: int,
    heap_k: int,
    cycles: int,
    source: bool = False,
    layout: str = "plain",
    firmware: str | None = None,
) -> dict[str, Any]:
    dev = f"minheap-{uuid.uuid4().hex[:8]}"
    flash = Flash(tmp / dev)
    flash.install_example(
        "env_sensor", device_id=dev, broker="127.0.0.1", port=port, period_ms=0, cycles=cycles, wdt_ms=0
    )
    flash.install_library(mpy=not source, frozen=firmware is not None)
    if not source:
        flash.compile_app()
    if layout == "ota":
        slot_layout(flash)
    board = Board(flash, heapsize=f"{heap_k}k", firmware=firmware).start()
    rc = board.wait(180)
    console = board.console()
    last = console.strip().splitlines()[-1] if console.strip() else ""
    probe: dict[str, Any] = {"heap_k": heap_k, "ok": False, "sent": 0, "receipt_mode": None}
    if rc == 0 and "IGGY-DONE" in console and "fatal" not in console:
        done = board.done()
        probe["sent"] = done.get("sent", 0)
        probe["receipt_mode"] = done.get("receipt_mode")
        probe["receipts"] = done.get("receipts", 0)
        probe["heap_free"] = done.get("heap_free")
        probe["ok"] = probe["sent"] >= cycles and probe["receipt_mode"] == "on"
    probe["last"] = last[:160]
    return probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--lo", type=int, default=32)
    ap.add_argument("--hi", type=int, default=160)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--source", action="store_true", help="the library as .py (compiled on the board)")
    ap.add_argument(
        "--layout",
        choices=("plain", "ota"),
        default="plain",
        help="ota: the loader and the app in slot s/a/, as provisioning writes it for updates",
    )
    ap.add_argument("--frozen", action="store_true", help="on a firmware with the library frozen in")
    args = ap.parse_args()
    if args.frozen and args.source:
        ap.error("--frozen has no library on the flash to compile: leave out --source")
    firmware = frozen.for_bench(args.frozen)
    probe_args = (args.cycles, args.source, args.layout, firmware)
    with tempfile.TemporaryDirectory(prefix="iggy-min-heap-") as t:
        tmp = Path(t)
        broker = Broker(tmp / "broker").start()
        responder = ReceiptResponder(broker)
        try:
            lo, hi = args.lo, args.hi  # invariant: lo fails (assumed), hi runs (checked)
            best = runs(tmp, broker.port, hi, *probe_args)
            print(json.dumps({"bench": "device_min_heap_probe", **best}), flush=True)
            if not best["ok"]:
                raise SystemExit(f"env_sensor does not run even in {hi}k: {best}")
            while hi - lo > args.step:
                mid = (lo + hi) // 2 // args.step * args.step
                if mid <= lo:
                    mid = lo + args.step
                probe = runs(tmp, broker.port, mid, *probe_args)
                print(json.dumps({"bench": "device_min_heap_probe", **probe}), flush=True)
                if probe["ok"]:
                    hi, best = mid, probe
                else:
                    lo = mid
            print(
                json.dumps(
                    {
                        "bench": "device_min_heap",
                        "example": "env_sensor",
                        "library": "source" if args.source else "mpy",
                        "layout": args.layout,
                        **frozen.label(firmware),
                        "cycles": args.cycles,
                        "smallest_ok_k": hi,
                        "largest_failing_k": lo,
                        "sent": best["sent"],
                        "receipt_mode": best["receipt_mode"],
                        "receipts_seen": best.get("receipts", 0),
                        "receipts_answered": responder.receipts,
                        "word_bytes": word_bytes(firmware),
                        "load": [round(x, 2) for x in os.getloadavg()],
                    }
                )
            )
        finally:
            responder.close()
            broker.stop()


if __name__ == "__main__":
    main()
