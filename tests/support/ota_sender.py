"""OTA test parts at the MQTT boundary we own (issue 21), for the board-side tests
and bench/ota_device_bench.py until the agent's updater (h21g) is merged.

- ``install_ota_board``: the flash layout provisioning writes for over-the-air
  updates (device/README.md, "Over-the-air updates"): /main.py the fixed loader,
  the app in slot ``s/a/``, ``ota.json``, the library in /lib; the app is
  ``app_files`` (its version stamped in, for the tests).
- ``slot_layout``: an installed example moved into that layout with
  provisioning's own parts (agent/iggy_edge/provision/layout.py: the loader,
  ota.json with the example's default version): what the benches measure.
- ``app_files``: an app version (env_sensor with a version stamped into two of
  its modules, so a mix of two versions shows at import) or a broken one.
- ``OtaSender``: **a stand-in for the agent's updater**, speaking the contract
  (/work/ota-protocol.md; device/README.md) on a real broker: manifest, then one
  chunk per ``need`` (window 1), the chunk again on ``bad`` or after a timeout,
  the manifest again when the board says ``online``.  A plain MQTT 3.1.1 client on
  a socket, in a thread, as ``ReceiptResponder`` is.
- ``Supervisor``: the board's power: restarts the process after a reset, a
  watchdog or deep sleep, and after ``power_cut()`` (SIGKILL).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from iggy_edge import mqtt_codec
from iggy_edge.provision import layout as provision_layout

from .broker import Broker
from .micropython import EXAMPLES_DIR, Board, Flash, mpy_cross

LOADER = "from iggy_device import otaboot\n\notaboot.run()\n"
RESTART_EXITS = (75, 76, 77)  # tests/device/stubs/machine.py: deep sleep, watchdog, reset()


def app_files(version: str, broken: str | None = None, pad: int = 0, mpy: bool = False) -> dict[str, bytes]:
    """env_sensor as an update would carry it: main.py and bme280.py, each with
    ``version`` stamped in; main.py prints ``IGGY-APP main=V lib=V`` at import, so
    a board running a mix of two versions says so.  ``broken``: "syntax" (a
    SyntaxError in main.py), "import" (raises at import), "crash" (main() raises
    every boot: the last resort resets the board), "offline" (never connects: a
    wrong broker port).  ``pad``: bytes of filler data file (for a sized update).
    ``mpy``: bme280 as .mpy (main.py stays source, as on a board)."""
    src = EXAMPLES_DIR / "env_sensor"
    main = (src / "main.py").read_text()
    stamp = (
        f'APP_V = "{version}"\nprint("IGGY-APP main=" + APP_V + " lib=" + getattr(bme280, "APP_V", "?"))\n'
    )
    stamped = main.replace("import bme280\n", "import bme280\n\n" + stamp, 1)  # after the last import
    assert stamped != main, "env_sensor's main.py no longer imports bme280 on a line of its own"
    main = stamped
    if broken == "syntax":
        main += "\ndef oops(:\n"
    elif broken == "import":
        main = main.replace(stamp, stamp + 'raise RuntimeError("broken at import")\n', 1)
    elif broken == "crash":
        main = main.replace("    dev = Device(cfg)\n", '    raise RuntimeError("crash in main")\n', 1)
    elif broken == "offline":
        main = main.replace("    dev = Device(cfg)\n", '    cfg._v["port"] = 9\n    dev = Device(cfg)\n', 1)
    assert broken is None or main != (src / "main.py").read_text()
    files = {"main.py": main.encode()}
    lib = (src / "bme280.py").read_text() + f'\nAPP_V = "{version}"\n'
    if mpy:
        tmp = Path(f"/tmp/ota-mpy-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            (tmp / "bme280.py").write_text(lib)
            mpy_cross(tmp / "bme280.py", tmp / "bme280.mpy")
            files["bme280.mpy"] = (tmp / "bme280.mpy").read_bytes()
        finally:
            shutil.rmtree(tmp)
    else:
        files["bme280.py"] = lib.encode()
    if pad:
        files["blob.bin"] = random.Random(version).randbytes(pad)
    return files


def sized_update(version: str, kb: int) -> dict[str, bytes]:
    """env_sensor as `iggy-edge device update --example env_sensor` builds
    it (main.py source, bme280 as .mpy: a .py would be compiled by the new
    version on the board), padded with a data file to ``kb`` kB: what the
    heap test and bench/ota_device_bench.py send."""
    bare = sum(len(d) for d in app_files(version, mpy=True).values())
    return app_files(version, pad=max(0, kb * 1024 - bare), mpy=True)


def install_ota_board(
    flash: Flash, version: str, config: dict[str, Any], *, mpy: bool = True, **state: Any
) -> None:
    """What provisioning writes for OTA: /main.py the loader, env_sensor
    (``app_files(version)``) in s/a/, config at the root, ota.json, the library
    (as .mpy with ``mpy``).  ``state``: more ota.json keys (n, t: the trial's
    bounds)."""
    flash.install_example("env_sensor", **config)
    for f in ("main.py", "bme280.py"):
        (flash.root / f).unlink()
    slot = flash.root / "s" / "a"
    slot.mkdir(parents=True)
    for name, data in app_files(version, mpy=mpy).items():
        (slot / name).write_bytes(data)
    (flash.root / "main.py").write_text(LOADER)
    (flash.root / "ota.json").write_text(json.dumps({"cur": "a", "v": version, **state}))
    flash.install_library(mpy=mpy)


def slot_layout(flash: Flash, example: str = "env_sensor") -> None:
    """Move the installed app into the OTA layout as `device provision` writes
    it: the loader at /main.py, the app's files in slot s/a/, ota.json with
    the app's default version."""
    slot = flash.root / provision_layout.SLOT
    slot.mkdir(parents=True)
    files = []
    for f in sorted(flash.root.iterdir()):
        if f.is_file() and f.suffix in (".py", ".mpy"):
            files.append((f.name, f.read_bytes()))
            f.rename(slot / f.name)
    (flash.root / "main.py").write_text(provision_layout.LOADER)
    version = provision_layout.default_version(example, files)
    (flash.root / provision_layout.STATE_FILE).write_bytes(provision_layout.ota_state(version))


def install_provisioned(flash: Flash, config: dict[str, Any], *, frozen: bool = False) -> None:
    """env_sensor as `device provision --mpy` writes it for updates (library
    and bme280 as .mpy, main.py source, ``slot_layout``), with ``config``:
    what bench/ota_device_bench.py and bench/device_min_heap.py --layout ota
    measure.  ``frozen``: for a firmware with the library in it (no /lib)."""
    flash.install_example("env_sensor", **config)
    flash.install_library(mpy=True, frozen=frozen)
    flash.compile_app()
    slot_layout(flash)


def manifest(uid: str, version: str, files: dict[str, bytes], mpy: int | None = None) -> dict[str, Any]:
    entries = [[p, len(d), hashlib.sha256(d).hexdigest()] for p, d in files.items()]
    total = sum(len(d) for d in files.values())
    return {"t": "m", "id": uid, "v": version, "files": entries, "total": total, "mpy": mpy}


def booted_versions(console: str) -> list[tuple[str, str]]:
    """(main's version, its module's version) of every app import on the console."""
    out = []
    for line in console.splitlines():
        if line.startswith("IGGY-APP "):
            kv = dict(p.split("=", 1) for p in line.split()[1:])
            out.append((kv["main"], kv["lib"]))
    return out


class _Mqtt:
    """The few MQTT 3.1.1 packets a sender needs, on a socket."""

    def __init__(self, broker: Broker, client_id: str) -> None:
        self.sock = socket.create_connection((broker.host, broker.port), timeout=5)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._wlock = threading.Lock()
        self._pid = 0
        self._write(mqtt_codec.connect(client_id, keepalive=60))
        if self.packet()[0] != 0x20:
            raise AssertionError("ota sender: no CONNACK")

    def send(self, op: int, body: bytes) -> None:
        self._write(mqtt_codec.packet(op, body))

    def _write(self, data: bytes) -> None:
        with self._wlock:
            self.sock.sendall(data)

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise EOFError
            out += got
        return out

    def packet(self) -> tuple[int, bytes]:
        op = self._read(1)[0]
        size, shift = 0, 0
        while True:
            b = self._read(1)[0]
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        return op, self._read(size)

    def subscribe(self, *topics: str) -> None:
        self.send(0x82, b"\x00\x01" + b"".join(mqtt_codec.string(t) + b"\x01" for t in topics))

    def publish(self, topic: str, payload: bytes) -> None:
        self._pid = self._pid % 65535 + 1
        self._write(mqtt_codec.publish(topic, payload, qos=1, mid=self._pid))


class OtaSender:
    """A stand-in for the agent's updater (see the module docstring): pushes one
    update to one board and records every reply.  ``flip``: (file, offset) of a
    chunk whose first send has one byte flipped (its header's sha256 is of the
    right bytes).  ``pause_after``: stop answering ``need`` after that many
    chunks until ``resume()``."""

    TERMINAL = ("done", "rolled_back", "failed")

    def __init__(
        self,
        broker: Broker,
        device: str,
        uid: str,
        version: str,
        files: dict[str, bytes],
        *,
        chunk: int = 1024,
        resend_s: float = 3.0,
        flip: tuple[int, int] | None = None,
        mpy: int | None = None,
        prefix: str = "edge",
        doc: dict[str, Any] | None = None,
    ) -> None:
        self.device = device
        self.uid = uid
        self.data = list(files.values())
        self.doc = doc if doc is not None else manifest(uid, version, files, mpy)  # doc: a bad one, for tests
        self.chunk = chunk
        self.resend_s = resend_s
        self.flip = flip
        self.down = f"{prefix}/{device}/down/ota"
        self.replies: list[dict[str, Any]] = []
        self.chunks_sent = 0
        self.bytes_sent = 0
        self.manifests_sent = 0
        self.started = time.monotonic()
        self.finished: float | None = None
        self._last: bytes | None = None
        self._sent: tuple[int, int] | None = None  # (file, offset) of the chunk sent last
        self._last_at = 0.0
        self._stop = threading.Event()
        self._paused = threading.Event()
        self.pause_after: int | None = None
        self._cv = threading.Condition()
        self._mqtt = _Mqtt(broker, f"ota-{uuid.uuid4().hex[:8]}")
        self._mqtt.subscribe(f"{prefix}/{device}/up/ota", f"{prefix}/{device}/status")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # -- the test's view ---------------------------------------------------
    def states(self) -> list[str]:
        with self._cv:
            return [r.get("st", "?") for r in self.replies]

    def result(self) -> dict[str, Any] | None:
        with self._cv:
            for r in self.replies:
                if r.get("id") == self.uid and r.get("st") in self.TERMINAL:
                    return r
        return None

    def wait_result(self, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                r = self.result()
                if r is not None:
                    return r
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"no terminal OTA reply in {timeout}s; replies: {self.replies[-20:]}"
                    )
                self._cv.wait(min(left, 0.2))

    def wait_state(self, st: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for r in self.replies:
                    if r.get("st") == st:
                        return r
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {st!r} in {timeout}s; replies: {self.replies[-20:]}")
                self._cv.wait(min(left, 0.2))

    def resume(self) -> None:
        self.pause_after = None
        self._paused.clear()
        if self._last is not None:
            self._resend()

    def probe(self) -> None:
        self._mqtt.publish(self.down, b'{"t":"q"}')

    def abort(self) -> None:
        self._mqtt.publish(self.down, json.dumps({"t": "x", "id": self.uid}).encode())

    def send_manifest(self) -> None:
        self._send(json.dumps(self.doc, separators=(",", ":")).encode())
        self.manifests_sent += 1

    # -- the updater -------------------------------------------------------
    def _send(self, payload: bytes) -> None:
        if not payload.startswith(b'{"t":"c"'):
            # after a manifest the board's need is answered, whatever it is (as the agent's updater)
            self._sent = None
        self._last = payload
        self._last_at = time.monotonic()
        self._mqtt.publish(self.down, payload)

    def _resend(self) -> None:
        if self._last is not None:
            self._send(self._last)

    def _chunk(self, f: int, o: int, corrupt: bool, n: int | None = None) -> None:
        data = self.data[f][o : o + min(self.chunk, n or self.chunk)]
        head = {"t": "c", "id": self.uid, "f": f, "o": o, "h": hashlib.sha256(data).hexdigest()}
        if corrupt:
            data = bytes([data[0] ^ 0x01]) + data[1:]
        self.chunks_sent += 1
        self.bytes_sent += len(data)
        self._send(json.dumps(head, separators=(",", ":")).encode() + b"\n" + data)

    def _on_reply(self, doc: dict[str, Any]) -> None:
        with self._cv:
            self.replies.append(doc)
            self._cv.notify_all()
        if doc.get("id") != self.uid:
            return
        st = doc.get("st")
        if st in self.TERMINAL:
            self.finished = time.monotonic()
            self._last = None
        elif st in ("need", "bad"):
            if self.pause_after is not None and self.chunks_sent >= self.pause_after:
                self._paused.set()
                return
            f, o = int(doc["f"]), int(doc["o"])
            if st == "need" and (f, o) == self._sent and time.monotonic() - self._last_at < self.resend_s:
                return  # answered already: a second "need" for it (the greeting, a duplicate's answer)
            self._sent = (f, o)
            corrupt = st == "need" and self.flip == (f, o)
            if corrupt:
                self.flip = None  # once
            self._chunk(f, o, corrupt, doc.get("n"))  # at most what the board asks for
        elif st in ("staged", "trial"):
            self._last = None  # nothing to resend: the board reboots and reports

    def _run(self) -> None:
        self._mqtt.sock.settimeout(0.1)
        self.send_manifest()
        with contextlib.suppress(EOFError, OSError):
            while not self._stop.is_set():
                try:
                    op, body = self._mqtt.packet()
                except TimeoutError:
                    if (
                        self._last is not None
                        and not self._paused.is_set()
                        and time.monotonic() - self._last_at > self.resend_s
                    ):
                        self._resend()
                    continue
                if op & 0xF0 != 0x30:
                    continue
                tl = int.from_bytes(body[:2], "big")
                topic = body[2 : 2 + tl].decode()
                payload = body[2 + tl + (2 if op & 6 else 0) :]
                if op & 6:
                    self._mqtt.send(0x40, body[2 + tl : 4 + tl])  # PUBACK
                if topic.endswith("/status"):
                    if payload == b"online" and self.result() is None:
                        self.send_manifest()  # after a reconnect (or a reboot)
                    continue
                with contextlib.suppress(ValueError):
                    self._on_reply(json.loads(payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self._mqtt.send(0xE0, b"")
        self._mqtt.sock.close()


class Supervisor:
    """The board's power supply: runs ``board`` and starts it again after a
    reset (machine.reset(), the watchdog, deep sleep: the stand-in's exit
    codes) and after ``power_cut()``; other exits end it."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.exits: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._cut = False
        board.start()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            proc = self.board.proc
            assert proc is not None
            rc = proc.wait()
            with self._lock:
                if self._stop.is_set():
                    return
                self.exits.append(rc)
                if rc not in RESTART_EXITS and not self._cut:
                    self.board._close()  # noqa: SLF001 - our own board
                    return
                self._cut = False
                self.board._close()  # noqa: SLF001
                self.board.start()

    def power_cut(self) -> None:
        """SIGKILL: no shutdown code runs; the board boots again at once."""
        with self._lock:
            self._cut = True
            proc = self.board.proc
            if proc is not None and proc.poll() is None:
                proc.kill()

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            self.board.stop()
        self._thread.join(10)
