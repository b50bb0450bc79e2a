"""What one verified TLS session to the gateway's broker costs a board, under
the MicroPython Unix port (real umqtt.simple, device/iggy_device/tlsconn.py,
Mosquitto from the packaged snippet with its TLS listener, a gateway CA from
iggy_edge.gateway_ca).  One JSON line per figure:

- tls_gc_heap_bytes: gc.mem_alloc() after connect minus before (the
  MicroPython heap: SSL context, socket objects, umqtt client)
- tls_c_heap_kib: VmData growth of the process over the same span (mbedTLS
  allocates its record buffers and handshake state with the C allocator
  here; on an ESP32 it allocates from the ESP-IDF heap, also outside the
  MicroPython heap)
- tls_connect_ms: TCP + TLS handshake + MQTT CONNECT, median of the runs
- plain_gc_heap_bytes: the same without TLS, for reference

Run: .venv/bin/python bench/device_tls_bench.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from iggy_edge import gateway_ca  # noqa: E402

from bench._common import emit  # noqa: E402
from tests.support.gateway_broker import GatewayBroker  # noqa: E402
from tests.support.micropython import DEVICE_DIR, MPLIB_DIR, micropython_binary  # noqa: E402

BENCH = "device_tls"
SCRIPT = """
import gc, json, time
from umqtt.simple import MQTTClient
from iggy_device import tlsconn

def vmdata():
    f = open('/proc/self/status'); t = f.read(); f.close()
    for line in t.split(chr(10)):
        if line.startswith('VmData'):
            return int(line.split()[1])
    return -1

f = open('ca.der', 'rb'); ca = f.read(); f.close()
args = ('s1', '127.0.0.1', PORT, 's1', 'bench-password-0123', 60)
gc.collect(); a0 = gc.mem_alloc(); v0 = vmdata(); t0 = time.ticks_us()
if TLS:
    c = tlsconn.client(MQTTClient, args, tlsconn.Tls(ca, '127.0.0.1', 10))
else:
    c = MQTTClient(*args)
c.connect()
ms = time.ticks_diff(time.ticks_us(), t0) / 1000
gc.collect()
print(json.dumps({'gc': gc.mem_alloc() - a0, 'vmdata_kib': vmdata() - v0, 'ms': ms}))
c.disconnect()
"""


def run(flash: Path, port: int, tls: bool) -> dict[str, float]:
    binary = micropython_binary()
    assert binary is not None
    (flash / "b.py").write_text(SCRIPT.replace("PORT", str(port)).replace("TLS", str(tls)))
    # glibc grows its heap by 128 KiB at a time by default: with no top pad
    # VmData follows what is really allocated (to the page)
    env = {**os.environ, "MICROPYPATH": f"{DEVICE_DIR}:{MPLIB_DIR}", "MALLOC_TOP_PAD_": "0"}
    done = subprocess.run(
        [binary, "-X", "heapsize=128k", "b.py"],
        cwd=flash,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    runs = 1 if a.quick else a.runs
    work = Path(tempfile.mkdtemp(prefix="iggy-edge-tls-bench-"))
    work.chmod(0o755)
    try:
        paths = gateway_ca.CaPaths(
            ca_dir=work / "ca", server_cert=work / "server.crt", server_key=work / "server.key"
        )
        gateway_ca.init(paths, "bench", ["127.0.0.1"])
        paths.server_key.chmod(0o644)  # the broker may run as the mosquitto user
        flash = work / "flash"
        flash.mkdir()
        shutil.copyfile(paths.ca_der, flash / "ca.der")
        gw = GatewayBroker(
            devices={"s1": "bench-password-0123"}, tls_cert=paths.server_cert, tls_key=paths.server_key
        )
        with gw:
            tls = [run(flash, gw.tls_port, True) for _ in range(runs)]
            plain = [run(flash, gw.device_port, False) for _ in range(runs)]
        emit(BENCH, "machine", sys.platform, micropython=micropython_binary())
        emit(BENCH, "tls_gc_heap_bytes", statistics.median(r["gc"] for r in tls), "B")
        emit(BENCH, "tls_c_heap_kib", statistics.median(r["vmdata_kib"] for r in tls), "KiB")
        emit(BENCH, "tls_connect_ms", round(statistics.median(r["ms"] for r in tls), 2), "ms")
        emit(BENCH, "plain_gc_heap_bytes", statistics.median(r["gc"] for r in plain), "B")
        emit(BENCH, "plain_connect_ms", round(statistics.median(r["ms"] for r in plain), 2), "ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
