"""A fast MQTT 3.1.1 publisher for the benchmarks (run as its own process).

It writes pre-encoded PUBLISH packets on a raw socket with a window of
unacknowledged QoS1 messages, so the broker rather than the publisher sets
the pace (`mosquitto_pub -l` drops messages when stdin outruns it; a gmqtt
publisher spends most of its time in Python per message).  When the last
PUBACK (QoS1) or the PINGRESP after the last message (QoS0) is in, the broker
has taken every message.

    python bench/_publisher.py --port P --count N [--devices D] [--qos 1]
    python bench/_publisher.py --port P --rate 2000 --duration 20   # steady stream

Messages go round robin to ``edge/dev<i>/up/env`` with a per-device
``"seq"``, 60-byte JSON payloads.  Prints one JSON line: sent, seconds, rate.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import payload_60
from iggy_edge import mqtt_codec as codec


class Publisher:
    def __init__(self, port: int, *, qos: int, devices: int, window: int, first_seq: int = 0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.qos = qos
        self.window = window
        self.topics = [f"edge/dev{d}/up/env".encode() for d in range(devices)]
        self.seq = [first_seq] * devices
        self.n = 0
        self.inflight = 0
        self.buf = b""
        self.sock.sendall(codec.connect(f"bench-pub-{time.monotonic_ns()}", keepalive=60))
        connack = self._read_exact(4)
        if connack[0] != codec.CONNACK or codec.parse_connack(connack[2:])[1] != 0:
            raise RuntimeError(f"CONNACK refused: {connack!r}")

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("broker closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _packets(self, count: int) -> bytes:
        out = []
        devices = len(self.topics)
        for _ in range(count):
            d = self.n % devices
            self.seq[d] += 1
            self.n += 1
            mid = (self.n - 1) % 65535 + 1
            out.append(codec.publish(self.topics[d], payload_60(d, self.seq[d]), qos=self.qos, mid=mid))
        return b"".join(out)

    def _take_acks(self, block: bool) -> None:
        if not block:
            self.sock.setblocking(False)
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            chunk = b""
        finally:
            self.sock.setblocking(True)
        self.buf += chunk
        whole = len(self.buf) // 4  # PUBACK is 4 bytes: 0x40 0x02 mid
        self.inflight -= whole
        self.buf = self.buf[whole * 4 :]

    def send(self, count: int) -> None:
        """Publish `count` messages, keeping at most `window` unacknowledged."""
        left = count
        while left:
            room = left if not self.qos else min(left, self.window - self.inflight)
            if room > 0:
                room = min(room, 2000)
                self.sock.sendall(self._packets(room))
                left -= room
                if self.qos:
                    self.inflight += room
                    self._take_acks(block=False)
            else:
                self._take_acks(block=True)

    def finish(self) -> None:
        """Wait until the broker has taken everything sent."""
        while self.qos and self.inflight > 0:
            self._take_acks(block=True)
        self.sock.sendall(codec.PINGREQ_PACKET)  # answered after all earlier packets
        while True:
            if self._read_exact(2) == codec.PINGRESP_PACKET:
                break
        self.sock.sendall(codec.DISCONNECT_PACKET)
        self.sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--count", type=int, default=0, help="messages to publish as fast as possible")
    ap.add_argument("--rate", type=float, default=0.0, help="steady messages/s (with --duration)")
    ap.add_argument("--duration", type=float, default=0.0)
    ap.add_argument("--qos", type=int, default=1, choices=(0, 1))
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--first-seq", type=int, default=0)
    a = ap.parse_args()
    pub = Publisher(a.port, qos=a.qos, devices=a.devices, window=a.window, first_seq=a.first_seq)
    started = time.perf_counter()
    if a.rate and a.duration:
        tick = 0.01
        sent = 0
        while (elapsed := time.perf_counter() - started) < a.duration:
            due = int(elapsed * a.rate) - sent
            if due > 0:
                pub.send(due)
                sent += due
            time.sleep(tick)
    else:
        pub.send(a.count)
    pub.finish()
    seconds = time.perf_counter() - started
    print(json.dumps({"sent": pub.n, "seconds": seconds, "rate": pub.n / seconds if seconds else 0.0}))


if __name__ == "__main__":
    main()
