"""Board updates, the gateway's share (agent/iggy_edge/ota/, docs/ota.md).

A fresh Mosquitto (in memory), the real agent in this process with the
updater at its default limits, and the scripted board of the tests
(tests/support/ota_board.py: it answers at once, no flash, no MicroPython),
over loopback.  Per run, one update of an app of `--kb` kB:

* ``download_s``: from the board's first message (the probe) to its
  ``staged`` (probe, manifest, every chunk asked for and sent, window 1);
* ``total_s``: from the request in ota.db to ``done`` (adds the agent's
  pick-up, at most a second, and the board's pretend reboot and trial);
* ``chunks`` and ``bytes_on_wire``: what went down on ``down/ota`` (MQTT
  payload bytes: every chunk's JSON line and data, the manifest, the probe).

The real board's figures (flash writes, sha256 on the ESP32, heap) are the
device side's benches; this one says what the gateway and the broker add.

    .venv/bin/python bench/ota_bench.py [--quick] [--kb 30] [--repeat 3] [--nodelay | --packaged-conf]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import broker as make_broker  # noqa: I001 - _common puts the repository on sys.path
from _common import emit, emit_machine, spread

from iggy_edge.config import parse_config
from iggy_edge.ota.updater import Limits
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.ota_agent import app, request, rows, running, wait_state
from tests.support.ota_board import Script, ScriptedBoard

BENCH = "ota"


PACKAGED_CONF = Path(__file__).resolve().parents[1] / "packaging" / "mosquitto" / "iggy-edge.conf"


def packaged_settings() -> str:
    """The broker-wide lines of the packaged Mosquitto config (the .deb's
    /etc/mosquitto/conf.d/iggy-edge.conf): everything before its listeners
    (their ports, password files and ACLs are the gateway's, not a bench's)."""
    out = []
    for line in PACKAGED_CONF.read_text().splitlines():
        word = line.split("#", 1)[0].split()
        if not word:
            continue
        if word[0] in ("per_listener_settings", "listener"):
            break
        if word[0] != "autosave_interval":  # the bench's broker runs in memory
            out.append(" ".join(word))
    return "\n".join(out)


async def one(workdir: Path, kb: int, nodelay: bool, packaged: bool = False) -> dict[str, float]:
    b = make_broker(workdir / "broker")
    if packaged:
        b.extra_conf = packaged_settings()
    elif nodelay:
        b.extra_conf = "set_tcp_nodelay true"
    b.start()
    try:
        raw = {
            "gateway_id": "gw-bench",
            "state_dir": str(workdir / "state"),
            "mqtt": {"host": b.host, "port": b.port},
            "iggy": {"kind": "memory"},
            "metrics": {"enabled": False},
        }
        settings = parse_config(raw, source="bench", env={})
        art = app("v1", size=kb * 1024)
        async with running(settings, MemoryIggy(), Limits()):
            board = await ScriptedBoard(b.host, b.port, "dev-1", script=Script(switch_delay_s=0.0)).start()
            try:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await request(settings, art, [["dev-1"]])
                await wait_state(settings, "dev-1", "done", timeout=120)
                t_done = loop.time()
            finally:
                await board.stop()
            assert board.first_at is not None
            assert board.staged_at is not None
            assert rows(settings)["dev-1"]["board_version"] == "v1"
            return {
                "download_s": board.staged_at - board.first_at,
                "total_s": t_done - t0,
                "chunks": float(sum(board.chunks.values())),
                "bytes_on_wire": float(board.bytes_in),
            }
    finally:
        b.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short run (the smoke test)")
    ap.add_argument("--kb", type=int, default=30, help="app size in kB (default 30)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--nodelay", action="store_true", help="Mosquitto with set_tcp_nodelay true (its default is false)"
    )
    ap.add_argument(
        "--packaged-conf",
        action="store_true",
        help="Mosquitto with the broker-wide settings of packaging/mosquitto/iggy-edge.conf",
    )
    args = ap.parse_args()
    kb, repeat = (8, 1) if args.quick else (args.kb, args.repeat)
    emit_machine(BENCH)
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="ota-bench-") as d:
            runs.append(asyncio.run(one(Path(d), kb, args.nodelay, args.packaged_conf)))
        time.sleep(0.2)
    for key, unit in (("download_s", "s"), ("total_s", "s")):
        values = [r[key] for r in runs]
        emit(
            BENCH,
            key,
            round(sorted(values)[len(values) // 2], 3),
            unit,
            app_kb=kb,
            nodelay=args.nodelay,
            packaged_conf=args.packaged_conf,
            **spread(values, 3),
        )
    emit(BENCH, "chunks", runs[0]["chunks"], "messages", app_kb=kb)
    emit(BENCH, "bytes_on_wire", runs[0]["bytes_on_wire"], "bytes", app_kb=kb, payload_bytes=kb * 1024)


if __name__ == "__main__":
    main()
