# Over-the-air updates (issue 21), the board's receiver.  Loaded by the
# Device with the first message on down/ota, or at boot when something is
# pending (a download to resume, a trial to confirm, a report to send), and
# dropped again once nothing is: a board that is never updated never holds
# this code.  What is rare is in modules loaded for it and dropped:
# otaman.py (manifest, abort, probe), otastate.py (ota.json: the switch,
# the confirmation, the rollback).  Protocol and layout: device/README.md,
# "Over-the-air updates".
#   gateway -> board  {prefix}/{dev}/down/ota  one JSON line, then (chunks) raw bytes:
#       {"t":"m","id","v","files":[[path,size,sha256hex],..],"total","mpy"}  manifest
#       {"t":"c","id","f","o","h"}\n<bytes>   chunk of file f at offset o, h its sha256
#       {"t":"x","id"}  abort          {"t":"q"}  probe
#   board -> gateway  {prefix}/{dev}/up/ota    {"id","st",...}: need (f, o), bad (f, o),
#       staged, trial, done, rolled_back (why), failed (why), idle (v)
# Flow control: the gateway sends a chunk only for a "need" (window 1); the
# board derives what it needs from what is on flash in the staging slot, so
# a reconnect or a reboot resumes.  Every chunk's and every file's sha256 is
# checked; then the one atomic step (otastate.switch: a rename of ota.json)
# and a reset.  The new version runs in trial until its first reading is on
# the gateway (receipted; published when receipts are off): see run().
# Names are few and reused from the library (heap: otastate.py says why).
import json
import time
from binascii import hexlify
from hashlib import sha256

from micropython import const

from . import codec, fsutil, unload
from .node import NET_ERRORS

_SEP = const((",", ":"))
_S = const("s")  # the slots' directory
# bytes of data a chunk may carry (the "n" of need): umqtt takes a message in
# one allocation, and on a board's fragmented heap 1 kB was the one that failed
_CHUNK = const(512)
_RETRIES = const(3)  # a file whose sha256 fails more often in one boot fails the update


def state():
    from . import otastate

    return otastate


class Ota:
    def __init__(self, dev):
        self.dev = dev
        cfg = dev.cfg
        self.topic = codec.topic(cfg.topic_prefix, cfg.device_id, "up", "ota").encode()
        s = state()
        self.st = s.load()
        self.m = s.find(self.st)  # the manifest being downloaded (with its "slot"), or None
        unload("otastate")
        self.want = None  # [file, offset] wanted next
        self.n = 0  # sha256 failures of this download in this boot
        self.first = None  # seq of this boot's first reading (trial)
        self.t = time.ticks_ms()
        # dev.stats["connects"] of the session greeted (with need, trial): not
        # this one when a message of it loaded the receiver (it gets its answer)
        self.connects = dev.stats["connects"] if dev._client is not None else -1
        if self.m is not None:
            self.resume()

    # -- hooks (node.py) ----------------------------------------------------
    def published(self, seq):
        if self.first is None and "trial" in self.st:
            self.first = seq

    def poll(self):
        """From Device.poll, connected or not: the trial's confirmation or
        its deadline, the greeting of a new session, a pending report.
        Drops the receiver once nothing is pending."""
        try:
            self.run()
        except MemoryError as e:
            self.dev._oom(e)  # next time

    def run(self):
        dev = self.dev
        st = self.st
        if dev._client is not None and dev.stats["connects"] != self.connects:
            self.connects = dev.stats["connects"]  # a new session: say where the board is
            tr = st.get("trial")
            if tr is not None:
                self.send({"id": tr["id"], "st": "trial", "v": st.get("v")})
            else:
                self.need()
        c = dev._client
        if "trial" in st:
            if self.first is not None and c is not None and _release_to(dev.ring, self.first):
                state().done(st)
                unload("otastate")
                dev.log("ota: confirmed", st.get("v"))
            elif time.ticks_diff(time.ticks_ms(), self.t) > st.get("t", 300) * 1000:
                state().rewind(st, "not confirmed within %d s" % st.get("t", 300), True, dev)
        if c is None:
            return
        rep = st.get("rep")
        if rep is not None and self.send(rep):
            st.pop("rep", None)
            state().write(st)
            unload("otastate")
        if "trial" not in st and "rep" not in st and self.m is None:
            dev._ota = None  # nothing pending: drop this code (heap)
            unload("ota")

    def handle(self, msg):
        i = msg.find(b"\n")
        try:
            doc = json.loads(msg if i < 0 else msg[:i])
            t = doc["t"]
        except (ValueError, KeyError, TypeError):
            t = None
        if t == "c" and i > 0:
            self.write(doc, memoryview(msg)[i + 1 :])
        elif t in ("m", "x", "q"):
            msg = None
            from . import otaman

            try:
                otaman.handle(self, t, doc)
            finally:
                unload("otaman")
        else:
            self.dev.stats["bad_messages"] += 1
            self.dev.log("ota: bad message")

    # -- download -------------------------------------------------------------
    def write(self, doc, data):
        """A chunk: ``data`` of file ``f`` at offset ``o`` (straight from the
        message: no copy), appended once its sha256 is checked."""
        m = self.m
        if m is None or doc.get("id") != m["id"]:
            from . import otaman

            otaman.handle(self, "q", doc)  # a stray chunk: say where the board is
            unload("otaman")
            return
        f, o = doc.get("f"), doc.get("o")
        if [f, o] != self.want:
            self.need()  # a duplicate or a late resend: ask for what is wanted
            return
        path, size, _ = m["files"][f]
        h = doc.get("h")
        n = len(data)
        if not n or o + n > size or not isinstance(h, str) or hexlify(sha256(data).digest()) != h.encode():
            self.dev.log("ota: chunk %d at %d refused (sha256 or size)" % (f, o))
            self.send({"id": m["id"], "st": "bad", "f": f, "o": o})
            return
        with open(self.path(path), "ab") as fh:
            fh.write(data)
        self.dev.hw.feed()
        if self.resume():
            self.need()

    def path(self, p):
        return "%s/%s/%s" % (_S, self.m["slot"], p)

    def resume(self):
        """Set ``want`` from what the staging slot holds; when every file is
        there and its sha256 checked, switch (and reset).  False: nothing
        to ask."""
        m = self.m
        files = m["files"]
        for i in range(len(files)):
            path, size, want = files[i]
            p = self.path(path)
            have = fsutil.size(p)
            if have < 0:
                if "/" in path:
                    fsutil.makedirs(p.rpartition("/")[0])
                open(p, "wb").close()
                have = 0
            if have < size:
                self.want = [i, have]
                return True
            if have > size or digest(p) != want:
                fsutil.remove(p)
                self.n += 1
                self.dev.log("ota: %s sha256 does not match: fetching it again" % path)
                if self.n > _RETRIES:
                    from . import otaman

                    otaman.refuse(self, m["id"], "sha256 of %s does not match" % path)
                    unload("otaman")
                    return False
                self.want = [i, 0]
                return True
            self.dev.hw.feed()
        state().staged(self, m)  # the switch; resets
        return False

    # -- replies ----------------------------------------------------------------
    def need(self):
        if self.want is not None:
            self.send({"id": self.m["id"], "st": "need", "f": self.want[0], "o": self.want[1], "n": _CHUNK})

    def send(self, doc):
        """QoS1 on up/ota; False when not connected (the next session's
        greeting, or the gateway's resend, makes up for it)."""
        dev = self.dev
        c = dev._client
        if c is None:
            return False
        try:
            if c.pid >= 65535:
                c.pid = 0
            c.publish(self.topic, json.dumps(doc, separators=_SEP), False, 1)
        except NET_ERRORS as e:
            dev._lost(e)
            return False
        dev._last_tx = time.ticks_ms()
        return True


def digest(path):
    """The sha256 (hex) of the file ``path``."""
    h = sha256()
    buf = bytearray(256)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(buf if n == 256 else memoryview(buf)[:n])
    return hexlify(h.digest()).decode()


def _release_to(ring, seq):
    """The ring holds no record up to ``seq`` any more: the gateway has it
    (receipted), or the broker (PUBACK, receipts off)."""
    segs = ring._segs
    i, off, read = 0, ring._off, ring._read
    while i < len(segs) and read >= segs[i][2]:
        i, off, read = i + 1, 0, 0
    if i >= len(segs):
        return True
    with open(ring._path(segs[i][0]), "rb") as f:
        f.seek(off)
        line = f.readline()
    from .ring import seq_of

    s = seq_of(line, line.find(b" ") + 1)
    return s is not None and s > seq
