"""TCP peers for the device tests, on loopback: a broker that never answers,
and a proxy in front of a real Mosquitto that can go silent (a dead broker
or a dead route: the TCP connection stays open, nothing comes back)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator

from tests.support.ports import free_port


class SilentPeer:
    """Accepts TCP, reads whatever comes, sends ``answer`` once (nothing by
    default: no CONNACK) and then never anything again."""

    def __init__(self, answer: bytes = b"") -> None:
        self.port = free_port()
        self.answer = answer
        self.accepted = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        answered: set[socket.socket] = set()
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = self._listener.accept()
                conn.setblocking(False)
                self.accepted += 1
                self._conns.append(conn)
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    if conn.recv(65536) and self.answer and conn not in answered:
                        answered.add(conn)
                        conn.sendall(self.answer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self._conns:
            conn.close()
        self._listener.close()


class FreezableProxy:
    """Forwards loopback TCP to ``target_port`` until ``freeze()``: from then
    on nothing is forwarded either way and nothing is closed, and new
    connections are accepted but get no answer.  ``thaw()`` resumes."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.target_port = target_port
        self.frozen = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._spawn(self._accept)

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._socks.append(down)
            self._spawn(self._serve, down)

    def _serve(self, down: socket.socket) -> None:
        while self.frozen.is_set() and not self._stop.is_set():
            self._stop.wait(0.05)  # accepted, silent until thawed
        if self._stop.is_set():
            return  # close() closes `down`
        try:
            up = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            down.close()
            return
        self._socks.append(up)
        for src, dst in ((down, up), (up, down)):
            self._spawn(self._pump, src, dst)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._stop.is_set():
            if self.frozen.is_set():
                self._stop.wait(0.05)
                continue
            try:
                ready, _, _ = select.select([src], [], [], 0.05)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def freeze(self) -> None:
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for _ in range(3):  # a thread may still start one more: join again
            for t in list(self._threads):  # every thread ends within about 0.1 s
                t.join(5)
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@contextlib.contextmanager
def silent_peer(answer: bytes = b"") -> Iterator[SilentPeer]:
    peer = SilentPeer(answer)
    try:
        yield peer
    finally:
        peer.close()


@contextlib.contextmanager
def freezable_proxy(target_port: int) -> Iterator[FreezableProxy]:
    proxy = FreezableProxy(target_port)
    try:
        yield proxy
    finally:
        proxy.close()
