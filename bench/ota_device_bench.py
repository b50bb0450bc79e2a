"""Over-the-air update figures for the board side (issue 21), on the real
MicroPython Unix port with the real umqtt.simple and a real Mosquitto.  The
gateway side is the test stand-in (tests/support/ota_sender.py: the contract's
updater at the MQTT boundary; bench/ota_bench.py times the agent's updater).
The update is env_sensor as `iggy-edge device update --example env_sensor`
builds it: main.py as source, bme280 as .mpy, padded with a data file to --kb.

Prints one JSON line per figure:
  {"bench": "ota_code_heap", ...}    heap the OTA modules take once imported (.mpy):
                                     resident while an update runs (ota), with it while
                                     a download runs (otadl) or a trial (otatrial),
                                     loaded for one message or step and dropped
                                     (otafit, otaman, otastate), and the loader's
                                     frame under the app (otaboot)
  {"bench": "ota_update", ...}       time to update a 30 kB app over loopback (manifest
                                     sent -> "done" from the new version), chunks, and
                                     flash bytes written (strace: every write() into the
                                     board's flash outside its data/ ring and the
                                     stand-ins' files)
  {"bench": "ota_min_heap", ...}     smallest heap in which env_sensor (library .mpy,
                                     receipts on and answered) keeps publishing while an
                                     update of the same size is downloaded and applied
                                     (--min-heap; beside bench/device_min_heap.py's
                                     figure for env_sensor alone)

Run: .venv/bin/python bench/ota_device_bench.py [--kb 30] [--min-heap --lo 64 --hi 160] [--frozen]
On the 32-bit float32 build: the same with .venv32/bin/python.  ``--frozen``: on
a firmware with the library and umqtt frozen in (tests/support/frozen.py; the
32-bit float32 port): ota_code_heap is then what importing the frozen modules
puts on the heap (their functions and globals; the bytecode stays in the firmware).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support import frozen  # noqa: E402
from tests.support.broker import Broker  # noqa: E402
from tests.support.micropython import (  # noqa: E402
    DEVICE_DIR,
    MPLIB_DIR,
    STUBS_DIR,
    Board,
    Flash,
    ReceiptResponder,
    board_config,
    mpy_cross,
    require_micropython,
    word_bytes,
)
from tests.support.ota_sender import OtaSender, Supervisor, install_provisioned, sized_update  # noqa: E402

CHUNK = 1024  # the gateway's chunk; the board asks for at most its own ("n" in need)
_CODE_HEAP = """
import gc, sys
sys.path.insert(0, "lib")
from iggy_device import node, ring, fsutil
r = {}
for name in ("otaboot", "otastate", "ota", "otaman", "otadl", "otafit", "otatrial"):
    gc.collect(); a = gc.mem_alloc()
    __import__("iggy_device." + name)
    gc.collect(); r[name] = gc.mem_alloc() - a
print("HEAP", r)
"""


def code_heap(tmp: Path, firmware: str | None = None) -> dict[str, Any]:
    lib = tmp / "codeheap" / "lib"
    if firmware is None:  # else the firmware has them
        for pkg, src_dir in (("iggy_device", DEVICE_DIR / "iggy_device"), ("umqtt", MPLIB_DIR / "umqtt")):
            for src in src_dir.glob("*.py"):
                mpy_cross(src, lib / pkg / (src.stem + ".mpy"))
    for src in STUBS_DIR.glob("*.py"):
        mpy_cross(src, lib / (src.stem + ".mpy"))
    (tmp / "codeheap" / "h.py").write_text(_CODE_HEAP)
    out = subprocess.run(
        [firmware or require_micropython(), "h.py"],
        cwd=tmp / "codeheap",
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "MICROPYPATH": f"{lib}:.frozen" if firmware else str(lib)},
    ).stdout
    got: dict[str, int] = json.loads(out.split("HEAP ", 1)[1].replace("'", '"'))
    return {
        "bench": "ota_code_heap",
        "bytes": got,
        "word_bytes": word_bytes(firmware),
        **frozen.label(firmware),
    }


class StracedBoard(Board):
    """The board under strace: every write() with the file it went to."""

    trace: Path | None = None

    def command(self) -> list[str]:
        assert self.trace is not None
        return [
            "strace",
            "-A",
            "-f",
            "-qq",
            "-y",
            "-e",
            "trace=write,pwrite64",
            "-o",
            str(self.trace),
            *super().command(),
        ]


def flash_bytes(trace: Path, root: Path) -> dict[str, int]:
    """Bytes written per kind of file in the board's flash."""
    out = {"app_slot": 0, "state": 0, "other": 0}
    pat = re.compile(r"(?:write|pwrite64)\((\d+)<([^>]*)>, .*\) = (\d+)")
    for line in trace.read_text(errors="replace").splitlines():
        m = pat.search(line)
        if m is None or not m.group(2).startswith(str(root)):
            continue
        rel = m.group(2)[len(str(root)) + 1 :]
        n = int(m.group(3))
        if rel.startswith(("s/a/", "s/b/")):
            out["app_slot"] += n
        elif rel.startswith(("ota.json", "s/m.json", "fatal.txt")):
            out["state"] += n
        elif not rel.startswith(("data/", "_")):
            out["other"] += n
    return out


def update_once(
    tmp: Path,
    broker: Broker,
    heap: str,
    kb: int,
    *,
    receipts: bool,
    strace: bool = False,
    firmware: str | None = None,
) -> dict[str, Any]:
    dev = f"otabench-{uuid.uuid4().hex[:8]}"
    flash = Flash(tmp / dev)
    cfg = board_config(broker.host, broker.port, dev, period_ms=100, receipts=receipts, wdt_ms=0)
    install_provisioned(flash, cfg, frozen=firmware is not None)
    files = sized_update("2", kb)
    board: Board
    if strace and shutil.which("strace"):
        board = StracedBoard(flash, heapsize=heap, firmware=firmware)
        board.trace = flash.root / "_strace.log"  # type: ignore[attr-defined]
    else:
        board = Board(flash, heapsize=heap, firmware=firmware)
    sup = Supervisor(board)
    deadline = time.monotonic() + 30
    while "[iggy] connected to" not in flash.text("_console.log"):
        if time.monotonic() > deadline or not sup.running():
            sup.stop()
            return {"ok": False, "why": "never connected", "console": flash.text("_console.log")[-300:]}
        time.sleep(0.05)
    sender = OtaSender(broker, dev, "u-" + dev, "2", files, chunk=CHUNK)
    try:
        result = sender.wait_result(60)
    except AssertionError as e:
        result = {"st": "none", "why": str(e)[:200]}
    finally:
        sender.close()
        time.sleep(0.3)
        sup.stop()
    console = flash.text("_console.log")
    probe: dict[str, Any] = {
        # a MemoryError the library caught (a message refused, a session restarted) is
        # counted, not a failure: the update goes on; a fatal one (reset) is
        "ok": result.get("st") == "done" and "fatal" not in console,
        "result": result.get("st"),
        "seconds": round((sender.finished or time.monotonic()) - sender.started, 2),
        "total_bytes": sender.doc["total"],
        "chunks_sent": sender.chunks_sent,
        "bytes_sent": sender.bytes_sent,
        "boots": board.boots,
        "out_of_memory": console.count("out of memory"),
    }
    if isinstance(board, StracedBoard) and board.trace is not None and board.trace.exists():
        probe["flash_bytes_written"] = flash_bytes(board.trace, flash.root)
    if not probe["ok"]:
        probe["console"] = console[-400:]
    return probe


def layout_runs(tmp: Path, broker: Broker, heap_k: int, cycles: int, firmware: str | None) -> dict[str, Any]:
    """env_sensor in the OTA layout (the loader, the app in a slot), no update:
    as bench/device_min_heap.py's probe (300 readings, receipts on and answered)."""
    dev = f"otalayout-{uuid.uuid4().hex[:8]}"
    flash = Flash(tmp / dev)
    cfg = {"device_id": dev, "broker": broker.host, "port": broker.port, "period_ms": 0, "cycles": cycles}
    install_provisioned(flash, {**cfg, "wdt_ms": 0}, frozen=firmware is not None)
    board = Board(flash, heapsize=f"{heap_k}k", firmware=firmware).start()
    rc = board.wait(180)
    console = board.console()
    probe: dict[str, Any] = {"heap_k": heap_k, "ok": False, "sent": 0}
    if rc == 0 and "IGGY-DONE" in console and "fatal" not in console:
        done = board.done()
        probe["sent"] = done.get("sent", 0)
        probe["ok"] = probe["sent"] >= cycles and done.get("receipt_mode") == "on"
    else:
        probe["last"] = console.strip().splitlines()[-1][:160] if console.strip() else ""
    return probe


def search(lo: int, hi: int, step: int, probe: Any) -> tuple[int | None, int]:
    """Smallest heap (k) in lo..hi for which ``probe(k)["ok"]``: (None, hi) if hi fails."""
    if not probe(hi)["ok"]:
        return None, hi
    while hi - lo > step:
        mid = max(lo + step, (lo + hi) // 2 // step * step)
        if probe(mid)["ok"]:
            hi = mid
        else:
            lo = mid
    return hi, lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kb", type=int, default=30, help="size of the update (app files)")
    ap.add_argument("--heap", default="160k", help="heap of the board for the timed update")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--min-heap", action="store_true", help="also search the smallest heap (slow)")
    ap.add_argument("--lo", type=int, default=56)
    ap.add_argument("--hi", type=int, default=160)
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--frozen", action="store_true", help="on a firmware with the library frozen in")
    args = ap.parse_args()
    firmware = frozen.for_bench(args.frozen)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="iggy-ota-bench-") as t:
        tmp = Path(t)
        print(json.dumps(code_heap(tmp, firmware)), flush=True)
        broker = Broker(tmp / "broker").start()
        responder = ReceiptResponder(broker)
        try:
            runs = [
                update_once(tmp, broker, args.heap, args.kb, receipts=False, firmware=firmware)
                for _ in range(args.runs)
            ]
            traced = update_once(
                tmp, broker, args.heap, args.kb, receipts=False, strace=True, firmware=firmware
            )
            print(
                json.dumps(
                    {"bench": "ota_update_traced", **{k: v for k, v in traced.items() if k != "console"}}
                ),
                flush=True,
            )
            secs = sorted(r["seconds"] for r in runs if r["ok"])
            print(
                json.dumps(
                    {
                        "bench": "ota_update",
                        "kb": args.kb,
                        "heap": args.heap,
                        "ok_runs": len(secs),
                        "runs": args.runs,
                        "seconds_median": secs[len(secs) // 2] if secs else None,
                        "seconds": secs,
                        "chunks_sent": runs[0]["chunks_sent"],
                        "total_bytes": runs[0]["total_bytes"],
                        "flash_bytes_written": traced.get("flash_bytes_written"),
                        "word_bytes": word_bytes(firmware),
                        **frozen.label(firmware),
                        "load": [round(x, 2) for x in load],
                    }
                ),
                flush=True,
            )
            if args.min_heap:

                def layout(k: int) -> dict[str, Any]:
                    p = layout_runs(tmp, broker, k, 300, firmware)
                    print(json.dumps({"bench": "ota_layout_min_heap_probe", **p}), flush=True)
                    return p

                def with_update(k: int) -> dict[str, Any]:
                    p = update_once(tmp, broker, f"{k}k", args.kb, receipts=True, firmware=firmware)
                    p.pop("console", None)
                    print(json.dumps({"bench": "ota_min_heap_probe", "heap_k": k, **p}), flush=True)
                    return p

                ok, failing = search(args.lo, args.hi, args.step, layout)
                print(
                    json.dumps(
                        {
                            "bench": "ota_layout_min_heap",
                            "what": "env_sensor in the OTA layout, no update, 300 readings receipted",
                            "smallest_ok_k": ok,
                            "largest_failing_k": failing,
                            "word_bytes": word_bytes(firmware),
                            **frozen.label(firmware),
                        }
                    ),
                    flush=True,
                )
                ok, failing = search(args.lo, args.hi, args.step, with_update)
                print(
                    json.dumps(
                        {
                            "bench": "ota_min_heap",
                            "what": f"env_sensor publishing while a {args.kb} kB update is applied",
                            "kb": args.kb,
                            "smallest_ok_k": ok,
                            "largest_failing_k": failing,
                            "word_bytes": word_bytes(firmware),
                            **frozen.label(firmware),
                            "receipts_answered": responder.receipts,
                            "load": [round(x, 2) for x in os.getloadavg()],
                        }
                    ),
                    flush=True,
                )
        finally:
            responder.close()
            broker.stop()


if __name__ == "__main__":
    main()
