# Receipts: a reading leaves the flash ring only when the gateway has it on
# disk, not when the broker answered PUBACK.
#
# The gateway publishes, retained, QoS0, on {prefix}/{device}/down/receipt:
#   {"seq": n, "crc": c}   the newest reading of this device it holds durably
#                          (seq and the CRC-32 of its payload)
# Naming the record by seq *and* CRC means a receipt can only release the
# reading it was made for: after a sequence reset (a new board, a damaged
# seq file) an old receipt names no record in the ring and releases nothing.
#
# - Every reading goes through the ring (``Ring.hold``); after PUBACK it stays
#   there, held, until a receipt covers it (``Ring.release``).
# - Each new connection re-sends from the oldest held reading, with its
#   original seq (the broker may have lost what it acknowledged); the gateway
#   recognises a copy by (topic, seq, CRC), stores it once and keeps its id.
# - Gate: on a new connection nothing is sent until a receipt arrives (the
#   retained one with the subscription, or the one the gateway publishes when
#   it sees this device's "online" status).  After a broker restart without
#   persistence the gateway's own subscription is gone until it
#   re-subscribes; what a device sent before that would be acknowledged by
#   the broker and dropped, and a receipt for a later reading would then
#   release it.  Waiting for a receipt means the gateway listens again.
# - Re-send: held readings with no receipt for a third of
#   ``receipt_timeout_ms`` are sent once more (the receipt may have been lost
#   with a gateway restart; the copy gets a fresh one).
# - Fallback (an older gateway, or receipts turned off there): no receipt for
#   ``receipt_timeout_ms`` while readings are held or after connecting (or
#   the ring filled before the first receipt): everything held is released
#   and PUBACK is enough again (mode "off", in ``diag``) until a receipt
#   arrives.
# - Memory: a few ints; the held records stay in flash.
import json
import time

from .ring import seq_of

try:
    from binascii import crc32
except ImportError:  # a port built without it: receipts are matched by seq only
    crc32 = None


class Receipts:
    def __init__(self, dev):
        cfg = dev.cfg
        self.dev = dev
        self.topic = cfg.topic_prefix + "/" + cfg.device_id + "/down/receipt"
        self.topic_b = self.topic.encode()
        # "waiting" (none seen yet), "on", "off" (PUBACK is enough)
        self.mode = "waiting"
        dev.ring.hold = True
        if dev.wake.get("ro"):
            # an earlier wake fell back (a gateway without receipts): PUBACK
            # is enough from the start, until a receipt arrives, so a battery
            # board pays the receipt_timeout_ms wait once, not every wake
            self.mode = "off"
            dev.ring.hold = False
        self.since = time.ticks_ms()  # oldest held reading sent, or the last receipt
        self.n = [0, 0, 0]  # receipts, fallbacks, re-sends
        self.go = True  # this connection may send (see before_send)
        self.resent = False

    def connected(self, client):
        """A new connection, before it says "online": subscribe first, so
        the receipt the gateway sends when it sees "online" cannot arrive
        before the subscription (it is not retained when it says "nothing of
        yours yet"), and send again from the oldest held reading once the
        gateway has shown it listens (any receipt)."""
        ring = self.dev.ring
        ring.rewind()
        self.go = not ring.hold
        self.since = time.ticks_ms()
        self.resent = False
        client.subscribe(self.topic, 0)

    def before_send(self, client, evicted=False):
        """Before the ring drains on ``client`` (and, with ``client`` None,
        after an append that had to evict held readings).  False: do not
        send yet (a new connection waits for the gateway's first receipt)."""
        ring = self.dev.ring
        now = time.ticks_ms()
        if not ring.hold:
            return True
        t = time.ticks_diff(now, self.since)
        limit = self.dev.cfg.receipt_timeout_ms
        if not self.go:
            if t > limit:
                self._off("none after connecting")
                return True
            return False
        if not ring.unreceipted():
            self.since = now  # the next held reading starts the clock
        elif evicted and self.mode == "waiting":
            self._off("the ring filled before any receipt")
        elif t > limit:
            self._off("none in receipt_timeout_ms")
        elif t > limit // 3 and not self.resent:
            # the receipt may have been lost (a gateway restart): send the
            # held readings again once; the gateway answers copies too
            self.resent = True
            self.n[2] += 1
            ring.rewind()
        return True

    def _off(self, why):
        ring = self.dev.ring
        n = ring.release_all()
        ring.hold = False
        self.go = True
        self.mode = "off"
        self.dev.wake["ro"] = 1  # RTC memory: the next wake starts "off"
        self.n[1] += 1
        self.dev.log("receipts:", why, "-", n, "held readings released; PUBACK is enough until a receipt")

    def handle(self, raw):
        ring = self.dev.ring
        try:
            doc = json.loads(raw)
            seq = int(doc["seq"])
            crc = doc.get("crc")
            if crc is not None:
                crc = int(crc)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if raw:  # an empty retained message clears the receipt: nothing to do
                self.dev.stats["bad_messages"] += 1
                self.dev.log("bad receipt:", repr(e))
            return
        self.n[0] += 1
        self.go = True
        if self.mode != "on":
            self.mode = "on"
            ring.hold = True
            self.dev.wake.pop("ro", None)
        if release(ring, seq, crc) or not ring.unreceipted():
            self.since = time.ticks_ms()
            self.resent = False

    def diag(self, d):
        n = self.n
        d["receipt_mode"] = self.mode
        d["receipts"] = n[0]
        d["receipt_fallbacks"] = n[1]
        d["receipt_resends"] = n[2]


def release(self, seq, crc=None):
    """``self``: the Ring (this lives here, so a device without receipts
    does not load it).  A receipt: the gateway holds the record with this ``seq`` (and
    payload CRC-32 ``crc``) durably, and everything sent before it.
    Releases the records up to it, plus the seq-less ones that follow it;
    returns how many.  The record may lie past the send cursor (a receipt
    that arrives after a reconnect's rewind): the send cursor skips it
    then.  A receipt that names no record in the ring (an old one, or one
    for a sequence the device has since reset) releases nothing."""
    if not len(self):
        return 0
    got = None
    first = True
    found = False
    i, off, read = 0, self._off, self._read
    while i < len(self._segs):
        seg = self._segs[i]
        end = seg[2]
        if read < end:
            with open(self._path(seg[0]), "rb") as f:
                f.seek(off)
                while read < end:
                    line = f.readline()
                    if not line.endswith(b"\n"):
                        break
                    off += len(line)
                    read += 1
                    start = line.find(b" ") + 1  # no copy of the payload: a diag line is 400 bytes
                    s = seq_of(line, start)
                    if s is None:
                        # sent: PUBACK covers it
                        if first and (i < self._si or (i == self._si and read <= self._sread)):
                            got = (i, off, read)
                    elif (
                        not found
                        and s == seq
                        and (crc is None or crc32 is None or crc32(memoryview(line)[start:-1]) == crc)
                    ):
                        found = True
                        first = True
                        got = (i, off, read)
                    else:
                        first = False
                        if found:
                            break
        if found and not first:
            break
        i += 1
        off = read = 0
    if not found or got is None:
        return 0
    n = len(self)
    self._release_to(got[0], got[1], got[2])
    return n - len(self)
