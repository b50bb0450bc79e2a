# The socket as umqtt.simple sees it.  umqtt (1.3.4 and later, what
# MicroPython firmware freezes) opens its socket itself inside connect(),
# with no timeout, and reads every inbound message whole.  This module stands
# in for umqtt's ``socket`` module, so that the socket it opens is a ``Wire``
# from the first byte on:
#
# - Every blocking step has a deadline (``timeout_ms`` after the step began:
#   TCP connect, TLS handshake reads, CONNACK, PUBACK, SUBACK, the rest of a
#   message whose first byte arrived).  umqtt's setblocking(True) would
#   otherwise clear any timeout.  A read that misses the deadline raises
#   OSError(ETIMEDOUT): the caller drops the connection and backs off.
# - Inbound packets are framed here: a PUBLISH whose payload is over
#   ``max_payload`` is read and thrown away in small chunks (never allocated
#   whole), acknowledged when it is QoS1 (it could never be kept, so the
#   broker must not send it again at every connect), counted and logged;
#   umqtt is handed an empty PINGRESP in its place.
# - Liveness: ``frames`` counts inbound packets, so the device can tell
#   whether its PINGREQ was answered.
# - Writes are gathered and sent as one segment when umqtt turns to reading
#   (umqtt writes a packet in four or five small writes; with Nagle on both
#   ends each QoS1 publish would wait for a delayed ACK).
import errno
import time

import socket as _socket
from micropython import const

_EAGAIN = (errno.EAGAIN, errno.ETIMEDOUT)  # what a timed-out read reports

# Set by the device before each connect (node.py): this module is what
# umqtt.simple sees as its ``socket`` module.
timeout_ms = 10000
max_payload = 4096
refused = 0  # inbound messages over max_payload, thrown away
cut = False  # the message umqtt was just handed is only its head: see Wire._big
feed = None
log = None
_addr = None
# The one scratch buffer (gathered writes, chunks of a refused message),
# shared by every Wire: one connection at a time.  Allocated once, at the
# first connect (a MemoryError there is a failed connect, retried): a new
# one at every reconnect was an allocation a fragmented heap could fail.
buf = None
_SIZE = const(384)
_HEAD = const(96)  # bytes of a message cut short: a command's id is in them


def socket(*args):
    return Wire(_socket.socket(*args))


def getaddrinfo(host, port, *args):
    # resolved once and cached: the ESP32 resolver takes no timeout (an IP
    # address as broker never resolves); the device sets _addr = None after
    # a failed connect (the address may have moved)
    global _addr
    if _addr is None or _addr[0] != (host, port):
        feed()
        _addr = ((host, port), _socket.getaddrinfo(host, port, *args))
        feed()
    return _addr[1]


class Wire:
    def __init__(self, sock):
        global buf
        self._s = sock  # what umqtt's bytes go through: TCP, or TLS on top of it
        self._raw = sock  # the TCP socket: it carries the timeouts
        self._t = timeout_ms
        if buf is None:
            buf = bytearray(_SIZE)
        self._buf = buf
        self._n = 0
        self._blocking = True
        self._cur = -1  # timeout currently set on the raw socket (ms)
        self._left = 0  # body bytes of the current inbound packet umqtt has not read
        self._pb = b""  # header bytes read ahead, handed to umqtt next
        self._dup = False  # the current packet is a redelivered PUBLISH
        self.frames = 0  # inbound packets: liveness
        self._deadline = time.ticks_add(time.ticks_ms(), self._t)  # a step's end

    # -- what umqtt calls ------------------------------------------------------
    def connect(self, addr):
        self._tmo(self._t)
        self._raw.connect(addr)
        feed()
        self._deadline = time.ticks_add(time.ticks_ms(), self._t)

    def settimeout(self, t):
        pass  # umqtt >= 1.6 sets its own (None: forever); ours stay

    def setblocking(self, value):
        self.flush()  # while still blocking-with-timeout: never a short write
        self._blocking = value

    def write(self, buf, n=None):
        if isinstance(buf, str):
            buf = buf.encode()
        if n is None:
            n = len(buf)
        if self._n + n > len(self._buf):
            self.flush()
            if n > len(self._buf):
                self._n = n
                self.flush(memoryview(buf))
                return n
        self._buf[self._n : self._n + n] = memoryview(buf)[:n]
        self._n += n
        return n

    def read(self, n):
        if not n:
            return b""  # an empty payload: not the next packet's first byte
        try:
            return self._read(n)
        except MemoryError:
            # mid-packet (a payload has no block): the rest of it is still on
            # the socket and must never be framed as the next packet, whichever
            # handler catches this; the session ends here, the broker sends
            # the message again (DUP: see _big)
            self._s.close()
            raise

    def _read(self, n):
        self.flush()
        if not self._left and not self._pb:
            # a packet boundary: frame the next packet
            if self._blocking:
                first = self._recv(1)
            else:
                self._tmo(0)
                try:
                    first = self._s.read(1)
                except OSError as e:
                    if e.args[0] not in _EAGAIN:
                        raise
                    first = None
                if not first:
                    return first  # None: nothing waiting; b"": closed
                # the rest of this packet is one step
                self._deadline = time.ticks_add(time.ticks_ms(), self._t)
            self._frame(first)
        out = self._pb[:n]
        self._pb = self._pb[len(out) :]
        k = n - len(out)
        if k > 0:
            data = self._big(k) if k > _SIZE and k == self._left else self._recv(k)
            self._left = self._left - k if self._left > k else 0
            out = out + data if out else data
        return out

    def close(self):
        try:
            self.flush()
        finally:
            self._s.close()

    # -- what the device and tlsconn call ------------------------------------------
    def flush(self, buf=None):
        if self._n:
            n = self._n
            self._n = 0
            self._tmo(self._t)
            self._s.write(memoryview(buf or self._buf)[:n])
            # an answer is due within timeout_ms of what we sent
            self._deadline = time.ticks_add(time.ticks_ms(), self._t)

    def wrap(self, fn):
        """TLS: ``fn(tcp_socket)`` returns the TLS stream; the handshake's
        reads are bounded by the TCP socket's timeout."""
        self._s = fn(self._raw)
        feed()
        self._deadline = time.ticks_add(time.ticks_ms(), self._t)
        return self

    # -- inside -------------------------------------------------------------------
    def _tmo(self, ms):
        if ms != self._cur:
            self._raw.settimeout(ms / 1000 if ms else 0)
            self._cur = ms

    def _big(self, n):
        """A large PUBLISH payload (the rest of the packet), read in place
        into one block allocated before a byte is read.  When the heap
        cannot hold it the first time, the connection drops and the broker
        sends it again (DUP); the second time only its first ``_HEAD``
        bytes go to umqtt (``cut``), which acknowledges it, the rest is
        read through the scratch buffer and forgotten, and the device
        refuses it by id: a heap that stays fragmented never gets the
        block, and taking the message again at every connect kept the
        connection from ever coming up."""
        global cut
        try:
            b = bytearray(n)
        except MemoryError:
            if not self._dup:
                raise
            b = bytearray(_HEAD)
            self._recv(_HEAD, b)
            self._recv(n - _HEAD, True)
            cut = True
            return b
        self._recv(n, b)
        return b

    def _recv(self, n, drop=False):
        """Exactly ``n`` bytes, blocking until the step's deadline.  With
        ``drop`` True they go through the scratch buffer and are forgotten,
        with a bytearray they go into it; then progress re-arms the
        deadline and feeds the watchdog (a large message on a slow link is
        not a hung one)."""
        out = b""
        b = drop is not True and drop
        m = memoryview(b or self._buf)
        i = 0
        while n > 0:
            ms = time.ticks_diff(self._deadline, time.ticks_ms())
            if ms <= 0:
                raise OSError(errno.ETIMEDOUT)
            # what is left of the step, rounded up to a quarter of it: a read
            # ends at most timeout_ms / 4 late, and settimeout (a system call)
            # runs at most four times per step instead of at every read
            q = (self._t >> 2) or 1
            ms = (ms + q - 1) // q * q
            self._tmo(ms if ms < self._t else self._t)
            try:
                if b:
                    got = self._s.readinto(m[i : i + n])
                elif drop:
                    got = self._s.readinto(m[: min(n, len(m))])
                else:
                    data = self._s.read(n)
                    got = len(data) if data is not None else None
            except OSError as e:
                if e.args[0] not in _EAGAIN:
                    raise
                got = None
            if got == 0:
                raise OSError("mqtt: connection closed by the broker")
            if got:
                n -= got
                i += got
                if drop:
                    self._deadline = time.ticks_add(time.ticks_ms(), self._t)
                    feed()
                else:
                    out = out + data if out else data
        return out

    def _frame(self, first):
        global refused
        op = first[0]
        h = first
        size = 0
        sh = 0
        while True:
            b = self._recv(1)
            h += b
            size |= (b[0] & 0x7F) << sh
            if not b[0] & 0x80:
                break
            sh += 7
            if sh > 21:
                raise OSError("mqtt: malformed packet length")
        self.frames += 1
        self._dup = op & 0xF8 == 0x38
        if op & 0xF0 == 0x30 and size >= 2:
            b = self._recv(2)
            topic_len = b[0] << 8 | b[1]
            qos = op & 6
            payload = size - 4 - topic_len if qos else size - 2 - topic_len
            if payload > max_payload:
                # read it in chunks and forget it; ack a QoS1 one: it can
                # never fit, so the broker must not send it at every connect
                topic = self._recv(min(topic_len, 48))
                self._recv(topic_len - len(topic), True)
                pid = self._recv(2) if qos else None
                self._recv(payload, True)
                if pid:
                    self.write(b"\x40\x02")
                    self.write(pid)
                    self.flush()
                refused += 1
                t = topic.decode()
                log("mqtt: refused a", payload, "byte message on", t, "> msg_max_bytes", max_payload)
                self._pb = b"\xd0\x00"  # umqtt gets a PINGRESP instead, which it ignores
                self._left = 0
                return
            h += b
            size -= 2
        self._pb = h
        self._left = size
