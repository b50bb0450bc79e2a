# Device: WiFi + MQTT session, telemetry with persisted sequence numbers,
# the offline ring buffer, commands with acks, retained config, duty cycle.
#
# Built on umqtt.simple only (micropython-lib).  umqtt.robust adds nothing we
# need (we own reconnect and backoff here) and its PyPI sdist cannot even be
# unpacked by pip because it contains a symlink.
#
# Message flow, one loop, no threads:
# - ``publish()`` numbers a reading and sends it directly when connected and
#   nothing is buffered; otherwise (or when the send fails) it goes to the
#   ring buffer in flash, so order is kept: the ring drains oldest first
#   before anything new is sent directly.
# - umqtt calls ``_on_msg`` from inside ``check_msg()`` and, during a QoS1
#   publish, from inside the wait for PUBACK.  Publishing from that callback
#   would nest a second PUBACK wait and swallow the first, so the callback only
#   queues; ``poll()`` handles the queue afterwards.
# - Receipts (receipts.py, on by default): readings stay in the ring after
#   PUBACK until the gateway's receipt covers them; a new connection re-sends
#   from the oldest unreceipted one.
# - Commands: run once per id (recent ids persisted with their ack), ack on
#   up/ack through the same buffered path as telemetry, so an ack survives a
#   lost connection too.
import gc
import json
import time

from umqtt import simple as _umqtt
from micropython import const
from umqtt.simple import MQTTClient, MQTTException

from . import codec, fsutil, unload, wire

# ring.py here, though only devinit.py and receipts.py use it: compiled on
# the board from source (344 lines) it needs the most heap after node.py,
# and right after node.py the heap is still in one piece (at Device() it had
# 32 kB free in holes of at most 2.7 kB, and env_sensor failed in 72k)
from .ring import Ring  # noqa: F401

# umqtt signals a dead connection in several ways: OSError from the socket,
# MQTTException for a refused CONNECT, IndexError when a read returns b"",
# AssertionError on an unexpected packet.
NET_ERRORS = (OSError, MQTTException, IndexError, AssertionError)
# CONNACK return codes (MQTT 3.1.1: 4 bad user name or password, 5 not
# authorized; MQTT 5 reason codes 0x86 / 0x87 likewise): the broker will keep
# refusing until the credentials change, so these get their own message,
# counter and a longer backoff.
AUTH_REFUSED = (4, 5, 0x86, 0x87)

_MSGS_PER_POLL = const(16)  # inbound messages handled per poll(): the loop stays responsive
_REFILLS = const(8)  # connect(): reconnects to fetch what a full inbox refused
_DIAG_RETRY_MS = 10000  # a diag message the heap had no block for: tried again after 10 s
_NTP_RETRY_MS = const(600000)  # a clock that did not sync is tried again after 10 min


class InboxFull(OSError):
    """Raised from umqtt's message callback: umqtt then does not acknowledge
    the message, and the connection is dropped so that the broker sends it
    (and everything after it) again at the next connect."""


class Device:
    _diag_skipped = 0  # diag messages the heap had no block for (set on the instance)
    _diag_at = 0
    # ota.py: loaded with the first down/ota message, or in __init__ when an
    # update is pending (a trial, a report to send, a download to resume).
    # Class attributes until then: no more entries in every Device's table.
    _ota = None
    app_v = None  # the version over-the-air updates installed (ota.json)

    def __init__(self, cfg, hw=None):
        # the body is devinit.py, boot-only (heap): loaded for the one
        # Device, unloaded when it is made.  receipts.py first, as it stays.
        R = None
        if cfg.receipts:
            from .receipts import Receipts as R
        from . import devinit

        try:
            devinit.init(self, cfg, hw)
        finally:
            unload("devinit")
        self.receipts = None if R is None else R(self)  # receipts.py, loaded only when on (heap)
        raw = fsutil.read("ota.json")  # over-the-air updates (see _ota, app_v)
        if raw:
            try:
                self.app_v = json.loads(raw).get("v")
            except (ValueError, AttributeError):
                pass
            raw = b'"trial"' in raw or b'"rep"' in raw or fsutil.exists("s/m.json")
        if raw is True:
            try:
                self._ota_get()
            except MemoryError as e:  # it comes again with the next down/ota message
                self._oom(e)

    # -- application API --------------------------------------------------------
    def command(self, name):
        """Decorator: ``@dev.command("set_relay") def f(args): return result``.
        Raise to ack "error" with the exception text."""

        def register(fn):
            self._handlers[name] = fn
            return fn

        return register

    def on_config(self, fn):
        """``fn(desired: dict)`` applies retained desired config.  It runs at
        boot with the persisted copy, and again when a different one
        arrives; it is persisted only after ``fn`` returned."""
        self._config_cb = fn
        if fsutil.exists(self.cfg.data_dir + "/desired.json"):
            self._inbound().boot_config(fn)
        return fn

    def publish(self, channel, reading, own=False):
        """Number ``reading`` (a dict) and send or buffer it; returns seq."""
        codec.check_channel(channel)
        n = self.seq.next()
        self._send(channel, codec.encode_reading(n, self.hw.unix_time(), reading, own))
        if self._ota is not None and not own:
            self._ota.published(n)  # an update's trial confirms with its first reading
        return n

    def poll(self):
        """One service step: connect when due, handle incoming messages,
        drain the buffer, keep the session alive.  Never blocks longer than a
        connection attempt."""
        self.hw.feed()
        if self._ota is not None:
            self._ota.poll()  # an update's trial: confirmed, or out of time (connected or not)
        if self._inbox:
            self._handle_inbox()  # taken in before a reconnect for the rest
        if self._client is None and not self._connect_if_due():
            return False
        try:
            for _ in range(_MSGS_PER_POLL):
                if self._client is None:
                    break
                if self._client.check_msg() is None and not self._inbox:
                    break
                self._handle_inbox()
            self._handle_inbox()
            self._drain(self.cfg.drain_per_poll)
            self._report_drops()
            self._liveness()
        except NET_ERRORS as e:
            self._lost(e)
        except MemoryError as e:
            # mid-message: the stream is out of step, start over
            self._oom(e)
            self._lost(e)
        return self._client is not None

    def wait(self, ms, step_ms=100):
        """Sleep ``ms`` while servicing the connection and the watchdog."""
        start = time.ticks_ms()
        while True:
            self.poll()
            t = ms - time.ticks_diff(time.ticks_ms(), start)
            if t <= 0:
                return
            time.sleep_ms(t if t < step_ms else step_ms)

    def run(self, read, channel="telemetry", period_ms=None, cycles=None):
        """The usual sensor loop: every ``period_ms`` call ``read()`` (a dict
        or None) and publish it.  ``cycles`` > 0 stops after that many."""
        limit = self.cfg.cycles if cycles is None else cycles
        n = 0
        while True:
            start = time.ticks_ms()
            reading = read()
            if reading is not None:
                self.publish(channel, reading)
            self.poll()
            n += 1
            if limit and n >= limit:
                return n
            # re-read each cycle: a config callback may change the period
            ms = self.cfg.period_ms if period_ms is None else period_ms
            t = ms - time.ticks_diff(time.ticks_ms(), start)
            if t > 0:
                self.wait(t)

    def connected(self):
        return self._client is not None

    def connect(self):
        """Try to connect now (ignoring the backoff schedule), waiting for
        WiFi up to ``wifi_timeout_ms``; True when up."""
        for _ in range(_REFILLS):
            self._next_try = time.ticks_ms()
            while True:
                if self._connect_if_due():
                    return True
                if self._wifi_t0 is None:
                    break  # failed, not still joining the access point
                self.hw.feed()
                time.sleep_ms(50)
            if not self._refill:
                return False
            self._handle_inbox()  # then fetch what the full inbox refused
        return False

    def flush(self, budget_ms=5000):
        """Send what is buffered, within ``budget_ms``; True when empty.
        While a connection waits for the gateway's first receipt the budget
        grows by ``receipt_timeout_ms``: a gateway that sends no receipts is
        found out in this call (receipts.py falls back to PUBACK, and
        remembers it across deep sleep), not never on a board whose every
        wake is shorter than the fallback."""
        start = time.ticks_ms()
        r = self.receipts
        while len(self.ring):
            limit = budget_ms
            if r is not None and not r.go:
                limit += self.cfg.receipt_timeout_ms
            if time.ticks_diff(time.ticks_ms(), start) >= limit or not self.poll():
                break
        return not len(self.ring)

    def sleep(self, ms):
        """Duty cycle: deep sleep when configured (the process/board restarts
        afterwards; everything needed survives in flash and RTC memory),
        otherwise a serviced wait."""
        if not self.cfg.deep_sleep:
            self.wait(ms)
            return
        self.shutdown()
        self.hw.deepsleep(ms)

    def shutdown(self):
        """Persist cursors and state, publish ``offline`` and disconnect."""
        self._handle_inbox()  # acknowledged to the broker: run them before sleeping
        if self._client is not None:
            try:
                self._client.publish(self._t_status, b"offline", True, 1)
                self._client.disconnect()
            except (NET_ERRORS, MemoryError):
                _close(self._client)
            self._client = None
        self._handle_inbox()  # taken in during that last PUBACK wait (acks go to the ring)
        self.ring.flush()
        self.wake["seq"] = self.seq.peek()
        self._save_rtc()

    def diag(self):
        h = self.hw.heap()  # first: before the document is allocated
        d = self.ring.stats()
        d["heap_free"], d["heap_alloc"] = h
        d["reset"] = self.reset_cause
        d["seq_recovered"] = 1 if self.seq.recovered else 0
        if self.receipts is None:
            d["receipt_mode"] = "off"
        else:
            self.receipts.diag(d)
        for k in self.stats:
            d[k] = self.stats[k]
        # messages over msg_max_bytes and MemoryErrors count as bad messages:
        # no key of their own, the diag document stays under a dict size that
        # needs a larger contiguous block (about 8 kB more heap on the Unix port)
        d["bad_messages"] += wire.refused
        if self._diag_skipped:  # only once there is one (the document's size)
            d["diag_skipped"] = self._diag_skipped
        if self.app_v is not None:
            d["app_v"] = self.app_v
        return d

    def log(self, *args):
        if self._log_level:
            print("[iggy]", *args)

    # -- sending ------------------------------------------------------------------
    def _topic_up(self, channel):
        t = self._up.get(channel)
        if t is None:
            t = codec.topic(self._prefix, self.cfg.device_id, "up", channel)
            self._up[channel] = t
        return t

    def _send(self, channel, payload, flush=True):
        ring = self.ring
        if self._client is not None and not len(ring) and not ring.hold:
            try:
                self._pub(channel, payload)
                return
            except NET_ERRORS as e:
                self._lost(e)
            except MemoryError as e:  # receiving during the PUBACK wait
                self._oom(e)
                self._lost(e)
        if self._client is None or len(ring) > ring.unreceipted():
            self.stats["buffered"] += 1  # waits for a connection or behind others
        evicted = ring.evicted
        lost = ring.append(channel, payload)
        payload = None  # drained below: its block is free for the read-back
        if lost:
            self.log("buffer full: dropped", lost, "oldest readings, total", ring.dropped)
        if ring.evicted != evicted and self.receipts is not None:
            self.receipts.before_send(None, True)
        if flush and ring.hold and self._client is not None:
            try:  # held until its receipt: send it now, behind anything unsent
                self._drain(self.cfg.drain_per_poll)
            except NET_ERRORS as e:
                self._lost(e)
            except MemoryError as e:  # receiving during the PUBACK wait, as above
                self._oom(e)
                self._lost(e)

    def _pub(self, channel, payload):
        c = self._client
        if c.pid >= 65535:
            c.pid = 0  # umqtt never wraps; packet id 0 is invalid in MQTT
        c.publish(self._topic_up(channel), payload, False, 1)
        self._last_tx = time.ticks_ms()
        self.stats["sent"] += 1

    def _drain(self, limit):
        r = self.receipts
        if r is not None and self._client is not None and not r.before_send(self._client):
            return  # a new connection waits for the gateway's first receipt
        n = 0
        while n < limit and self._client is not None:
            msg = self.ring.peek()
            if msg is None:
                return
            self._pub(msg[0], msg[1])
            self.ring.pop()
            self.hw.feed()
            n += 1
        # keep the loop responsive; the rest goes on the next poll

    def _report_drops(self):
        dropped = self.ring.dropped
        if dropped != self._reported_dropped and self._client is not None:
            # every new session and every change of the drop count.  A heap
            # without a block for the document (a board near its smallest
            # heap, right after connect) skips it, counted in diag_skipped,
            # and tries again after _DIAG_RETRY_MS: the session and the
            # readings stay (dropping the session came back at every connect).
            now = time.ticks_ms()
            if self._reported_dropped == -2 and time.ticks_diff(now, self._diag_at) < 0:
                return
            try:  # no copy of the document (diag() collects)
                p = codec.encode_reading(self.seq.peek(), self.hw.unix_time(), self.diag(), True)
            except MemoryError as e:
                self._diag_skipped += 1
                self._reported_dropped = -2  # tried again after _DIAG_RETRY_MS
                self._diag_at = time.ticks_add(now, _DIAG_RETRY_MS)
                self.log("diag skipped:", repr(e))
                return
            self._reported_dropped = dropped
            self.seq.next()  # numbered only once it exists: no gap in seq
            # held (receipts on): sent by the next drain, once this frame's
            # copy is gone, so reading it back needs no second block of its size
            self._send("diag", p, False)

    # -- connection -----------------------------------------------------------------
    def _connect_if_due(self):
        now = time.ticks_ms()
        if time.ticks_diff(now, self._next_try) < 0:
            return False
        cfg = self.cfg
        step = "wifi"
        try:
            if not self._wifi_up(now):
                return False  # still joining: readings go on meanwhile
            step = "mqtt"
            # umqtt opens its socket itself: make it a Wire (wire.py), so the
            # TCP connect, CONNACK, SUBACK and PUBACK waits all time out
            _umqtt.socket = wire
            c = self._new_client()
            c.set_callback(self._on_msg)
            c.set_last_will(self._t_status, b"offline", True, 1)
            try:
                self.hw.feed()
                c.connect(cfg.clean_session)
                self.hw.feed()
                if self.receipts is not None:
                    self.receipts.connected(c)  # before "online": see there
                c.publish(self._t_status, b"online", True, 1)
                self.hw.feed()
                c.subscribe(self._t_cmd, 1)
                self.hw.feed()
                c.subscribe(self._t_config, 1)
                self.hw.feed()
                c.subscribe(codec.topic(self._prefix, cfg.device_id, "down", "ota"), 1)
                self.hw.feed()
            except NET_ERRORS:
                _close(c)
                raise
            except MemoryError as e:
                _close(c)
                self._oom(e)
                raise OSError("out of memory") from None
        except NET_ERRORS as e:
            if isinstance(e, InboxFull):
                self._refill = True
                self._next_try = time.ticks_ms()
                self.log("inbox full: reconnecting for the rest")
                return False
            wire._addr = None
            self.stats["conn_failures"] += 1
            if step == "mqtt" and _refused_login(e):
                self.stats["auth_failures"] += 1
                ms = self.auth_backoff.next_ms()
                self._next_try = time.ticks_add(time.ticks_ms(), ms)
                self.log(
                    "mqtt: not authorized (CONNACK " + str(e.args[0]) + ") as user",
                    repr(cfg.user or cfg.device_id),
                    "- check user/password in config.local.json and the gateway's"
                    " `iggy-edge device credentials list`; retry in",
                    ms,
                    "ms",
                )
                return False
            ms = self.backoff.next_ms()
            self._next_try = time.ticks_add(time.ticks_ms(), ms)
            self.log(step, "connect failed:", repr(e), "retry in", ms, "ms")
            return False
        self._client = c
        self._last_tx = time.ticks_ms()
        self._last_rx = self._last_tx
        self._frames = c.sock.frames
        self._ping_at = None
        self.backoff.reset()
        self.auth_backoff.reset()
        self.stats["connects"] += 1
        self._reported_dropped = -1  # announce ourselves with a diag message
        self.log("connected to", cfg.broker, "buffered", len(self.ring))
        if cfg.ntp and self._clock_due() and time.ticks_diff(time.ticks_ms(), self._ntp_next) >= 0:
            # after the session is up, so a slow or unreachable NTP server
            # never delays it; a failed try again after _NTP_RETRY_MS
            self._ntp_next = time.ticks_add(time.ticks_ms(), _NTP_RETRY_MS)
            self.hw.feed()
            if self.hw.sync_clock():
                self.wake["ntp"] = self.hw.unix_time()
            self.hw.feed()
        return True

    def _clock_due(self):
        """The clock needs NTP: unset, or last set ``ntp_every_s`` ago (the
        RTC drifts, most in deep sleep, where the ESP32 runs it from its RC
        oscillator; the time of the last sync is kept in RTC memory)."""
        now = self.hw.unix_time()
        last = self.wake.get("ntp")
        return now is None or last is None or not 0 <= now - last < self.cfg.ntp_every_s

    def _wifi_up(self, now):
        """True when the link is up; False while joining (never blocks);
        OSError after ``wifi_timeout_ms`` without a link."""
        if self.hw.wifi_connected():
            self._wifi_t0 = None
            return True
        if self._wifi_t0 is None:
            self._wifi_t0 = now
            self.hw.wifi_begin(self.cfg.wifi_ssid, self.cfg.wifi_password)
            return self.hw.wifi_connected()
        if time.ticks_diff(now, self._wifi_t0) < self.cfg.wifi_timeout_ms:
            return False
        self._wifi_t0 = None
        raise OSError("wifi: no link after " + str(self.cfg.wifi_timeout_ms) + " ms")

    def _liveness(self):
        """While connected: the WiFi link is up, and the broker answers.
        A PINGREQ goes out after keepalive/2 s without traffic either way; no
        packet within the step timeout after it means the broker is gone."""
        c = self._client
        if c is None:
            return
        if not self.hw.wifi_connected():
            raise OSError("wifi: link lost")
        now = time.ticks_ms()
        w = c.sock
        if w.frames != self._frames:
            self._frames = w.frames
            self._last_rx = now
            self._ping_at = None
        if self._ping_at is not None:
            if time.ticks_diff(now, self._ping_at) > self._t_ms:
                raise OSError("mqtt: no PINGRESP within " + str(self._t_ms) + " ms")
            return
        half = self.cfg.keepalive * 500
        d = time.ticks_diff
        if half and (d(now, self._last_tx) > half or d(now, self._last_rx) > half):
            c.ping()
            w.flush()
            self._ping_at = now
            self._last_tx = now

    def _oom(self, err):
        gc.collect()
        self.stats["bad_messages"] += 1
        self.log("out of memory:", repr(err), "free", gc.mem_free())

    def _lost(self, err):
        self.log("connection lost:", repr(err))
        _close(self._client)
        self._client = None
        self._ping_at = None
        self.ring.flush()
        if isinstance(err, InboxFull):
            # not the network's fault: fetch the rest right away
            self._refill = True
            self._next_try = time.ticks_ms()
            return
        ms = self.backoff.next_ms()
        self._next_try = time.ticks_add(time.ticks_ms(), ms)

    def _new_client(self):
        cfg = self.cfg
        user = cfg.user
        if user is None and cfg.password is not None:
            user = cfg.device_id  # the gateway's convention: the device id is the MQTT user
        args = (cfg.device_id, cfg.broker, cfg.port, user, cfg.password, cfg.keepalive)
        if self._tls is None:
            return MQTTClient(*args)
        from . import tlsconn

        return tlsconn.client(MQTTClient, args, self._tls)

    # -- incoming -----------------------------------------------------------------
    def _on_msg(self, topic, msg):
        # runs inside umqtt's read loop: queue only, never publish here.
        # umqtt acknowledges the message when this returns, so what does not
        # fit is refused (no ack) and comes again after a reconnect.
        if wire.cut:  # only the head of a message the heap could not hold twice
            wire.cut = False
            self.stats["bad_messages"] += 1
            self.log("out of memory for a message on", topic)
            if topic != self._b_cmd:
                return
            topic = None  # a command: refused by id (_handle_inbox)
        n = len(msg)
        if self._inbox and self._inbox_bytes + n > self.cfg.inbox_bytes:
            self.stats["inbox_full"] += 1
            raise InboxFull("inbox full")
        self._inbox.append((topic, msg))
        self._inbox_bytes += n

    def _handle_inbox(self):
        self._refill = False
        while self._inbox:
            topic, msg = self._inbox.pop(0)
            self._inbox_bytes -= len(msg)
            try:
                if topic is None:
                    self._refuse(msg)  # cut short (_on_msg), acknowledged: answer it by id
                elif topic == self._b_cmd:
                    self._inbound().command(msg)
                elif topic == self._b_config:
                    self._inbound().config(msg)
                elif self.receipts is not None and topic == self.receipts.topic_b:
                    self.receipts.handle(msg)
                elif topic.endswith(b"/ota"):  # down/ota: the only other topic subscribed
                    self._ota_get().handle(msg)
            except MemoryError as e:
                self._oom(e)
                if topic == self._b_cmd:
                    # acknowledged to the broker already: refuse it to the
                    # gateway (an "error" ack) rather than lose it unheard
                    self._refuse(msg)
            msg = None
            gc.collect()

    def _refuse(self, msg):
        try:
            if not self._inbound().refuse(msg, "out of memory"):
                self.log("command lost: out of memory, no id found")
        except MemoryError as e:
            self.log("command lost: out of memory", repr(e))

    def _ota_get(self):
        if self._ota is None:
            from .ota import Ota

            self._ota = Ota(self)
        return self._ota

    def _inbound(self):
        h = self._in
        if h is None:
            from .commands import Inbound

            h = self._in = Inbound(self)
        return h

    # -- RTC memory (loaded by devinit.py) -------------------------------------
    def _save_rtc(self):
        self.hw.rtc_save(json.dumps(self.wake).encode())


def _refused_login(err):
    return isinstance(err, MQTTException) and len(err.args) > 0 and err.args[0] in AUTH_REFUSED


def _close(client):
    if client is not None and client.sock is not None:
        try:
            client.sock.close()
        except OSError:
            pass
