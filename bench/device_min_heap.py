"""Smallest MicroPython heap that runs the env_sensor example with the
library (and umqtt) as .mpy, as a board would run it: the real Unix port,
the real umqtt.simple, a real Mosquitto, ``cycles`` readings published.

Prints one JSON line per probe and a summary line:
  {"bench": "device_min_heap", "smallest_ok_k": N, "largest_failing_k": N-step, ...}

Run: .venv/bin/python bench/device_min_heap.py [--cycles 300] [--lo 32] [--hi 160] [--step 4] [--source]
The Unix port here has 8-byte words (x86-64): a 32-bit ESP32 needs less.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.broker import Broker  # noqa: E402
from tests.support.micropython import Board, Flash  # noqa: E402


def runs(tmp: Path, port: int, heap_k: int, cycles: int, source: bool = False) -> tuple[bool, str]:
    dev = f"minheap-{uuid.uuid4().hex[:8]}"
    flash = Flash(tmp / dev)
    flash.install_example(
        "env_sensor", device_id=dev, broker="127.0.0.1", port=port, period_ms=0, cycles=cycles, wdt_ms=0
    )
    flash.install_library(mpy=not source)
    if not source:
        flash.compile_app()
    board = Board(flash, heapsize=f"{heap_k}k").start()
    rc = board.wait(180)
    console = board.console()
    ok = rc == 0 and "IGGY-DONE" in console and "fatal" not in console
    last = console.strip().splitlines()[-1] if console.strip() else ""
    return ok, last[:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--lo", type=int, default=32)
    ap.add_argument("--hi", type=int, default=160)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--source", action="store_true", help="the library as .py (compiled on the board)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="iggy-min-heap-") as t:
        tmp = Path(t)
        broker = Broker(tmp / "broker").start()
        try:
            lo, hi = args.lo, args.hi  # invariant: lo fails (assumed), hi runs (checked)
            ok, last = runs(tmp, broker.port, hi, args.cycles, args.source)
            print(json.dumps({"bench": "device_min_heap_probe", "heap_k": hi, "ok": ok, "last": last}))
            if not ok:
                raise SystemExit(f"env_sensor does not run even in {hi}k: {last}")
            while hi - lo > args.step:
                mid = (lo + hi) // 2 // args.step * args.step
                if mid <= lo:
                    mid = lo + args.step
                ok, last = runs(tmp, broker.port, mid, args.cycles, args.source)
                print(json.dumps({"bench": "device_min_heap_probe", "heap_k": mid, "ok": ok, "last": last}))
                if ok:
                    hi = mid
                else:
                    lo = mid
            print(
                json.dumps(
                    {
                        "bench": "device_min_heap",
                        "example": "env_sensor",
                        "library": "source" if args.source else "mpy",
                        "cycles": args.cycles,
                        "smallest_ok_k": hi,
                        "largest_failing_k": lo,
                        "word_bytes": 8,
                    }
                )
            )
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
