"""How many qstrs (interned names and short strings) env_sensor's board holds,
and in how many pools: the plain layout, the OTA layout (provisioning's
loader and slot), and the OTA layout with a 30 kB update in progress
(the download's boot: the receiver, otaman and otastate all loaded).

Why it matters (device/README.md, memory): MicroPython's qstr pools grow by
doubling (20, 40, 80, 160, 320 entries: 620 in 5 pools); the 621st name
opens a 6th pool of 640 entries, about 4.7 kB of heap on a 32-bit board.

Each board runs the real example (library and app as .mpy, receipts on and
answered, a real Mosquitto); its main.py gets a few lines that print
``micropython.qstr_info()`` every 30 readings (they add 2 names, ``_r`` and
``_k``, to every count).  The update case installs the tests' stamped app
(``install_ota_board``: 4 names more, ``APP_V``...) as test_ota_heap.py does.

Prints one JSON line per case:
  {"bench": "device_qstrs", "case": "plain", "n_qstr": N, "n_pool": P, "qstr_bytes": B, ...}

``--names`` adds the list of the board's own qstrs (``qstr_info(1)``, the
names interned at run time, not the firmware's) to each line.

Run: .venv32/bin/python bench/device_qstrs.py [--source] [--case plain] [--names]
     (.venv/bin/python: the 64-bit port)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.broker import Broker  # noqa: E402
from tests.support.micropython import Board, Flash, ReceiptResponder, board_config  # noqa: E402
from tests.support.ota_sender import (  # noqa: E402
    OtaSender,
    Supervisor,
    app_files,
    install_ota_board,
    slot_layout,
)

HOOK = """    import micropython
    _r = read
    _k = [0]
    def read():
        _k[0] += 1
        if _k[0] % 30 == 0:
            micropython.qstr_info(ARG)
        return _r()
    n = dev.run(read, "env")"""


CASES = ("plain", "ota_layout", "ota_update")


def hook(main: Path, dump: bool = False) -> None:
    s = main.read_text()
    hooked = s.replace('    n = dev.run(read, "env")', HOOK.replace("ARG", "1" if dump else ""), 1)
    assert hooked != s, "env_sensor's main.py changed: the hook does not fit"
    main.write_text(hooked)


def counts(console: str) -> dict[str, int]:
    """The largest qstr_info line of the console (its last boot with most names)."""
    best = {"n_qstr": 0}
    for line in console.splitlines():
        if line.startswith("qstr pool:"):
            kv = dict(p.strip().split("=") for p in line[len("qstr pool:") :].split(","))
            got = {
                "n_pool": int(kv["n_pool"]),
                "n_qstr": int(kv["n_qstr"]),
                "qstr_bytes": int(kv["n_total_bytes"]),
            }
            if got["n_qstr"] > best["n_qstr"]:
                best = got
    return best


def names(console: str) -> list[str]:
    """The dynamic qstrs of the console's last ``qstr_info(1)`` dump (``Q(name)`` lines)."""
    out: list[str] = []
    for line in console.splitlines():
        if line.startswith("qstr pool:"):
            out = []
        elif line.startswith("Q(") and line.endswith(")"):
            out.append(line[2:-1])
    return out


def case(tmp: Path, broker: Broker, name: str, source: bool, dump: bool = False) -> dict[str, Any]:
    dev = f"qstr-{uuid.uuid4().hex[:8]}"
    flash = Flash(tmp / dev)
    if name in ("plain", "ota_layout"):
        cfg: dict[str, Any] = {"device_id": dev, "broker": broker.host, "port": broker.port}
        flash.install_example("env_sensor", **cfg, period_ms=0, cycles=40, wdt_ms=0)
        flash.install_library(mpy=not source)
        if not source:
            flash.compile_app()
        if name == "ota_layout":
            slot_layout(flash)
        hook(flash.root / ("s/a/main.py" if name == "ota_layout" else "main.py"), dump)
        Board(flash, heapsize="160k").start().wait(120)
    else:
        cfg = board_config(broker.host, broker.port, dev, period_ms=100, receipts=True, wdt_ms=0)
        install_ota_board(flash, "1", cfg, mpy=not source)
        hook(flash.root / "s/a/main.py", dump)
        board = Board(flash, heapsize="160k")
        sup = Supervisor(board)
        while "[iggy] connected to" not in flash.text("_console.log"):
            time.sleep(0.05)
        files = app_files("2", pad=30 * 1024 - sum(len(d) for d in app_files("2").values()))
        sender = OtaSender(broker, dev, "u-" + dev, "2", files)
        try:
            assert sender.wait_result(60).get("st") == "done"
        finally:
            sender.close()
            time.sleep(0.3)
            sup.stop()
    console = flash.text("_console.log")
    out = {"bench": "device_qstrs", "case": name, "library": "source" if source else "mpy"} | counts(console)
    if dump:
        out["names"] = names(console)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", action="store_true", help="the library as .py (compiled on the board)")
    ap.add_argument("--case", choices=CASES, action="append", help="only this case (repeatable)")
    ap.add_argument("--names", action="store_true", help="also list the names (micropython.qstr_info(1))")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="iggy-qstrs-") as t:
        tmp = Path(t)
        broker = Broker(tmp / "broker").start()
        responder = ReceiptResponder(broker)
        try:
            for name in args.case or CASES:
                print(json.dumps(case(tmp, broker, name, args.source, args.names)), flush=True)
        finally:
            responder.close()
            broker.stop()


if __name__ == "__main__":
    main()
