# Over-the-air updates (issue 21), the board's receiver.  Loaded by the
# Device with the first message on down/ota, or at boot when something is
# pending (a download to resume, a trial to confirm, a report to send), and
# dropped again once nothing is: a board that is never updated never holds
# this code.  The rest is in modules loaded for their part and dropped,
# one at a time beside this one (heap: on a 32-bit board the app leaves a
# few kB, in small holes): otadl.py (the download: chunks, sha256s, resume;
# loaded while one is in progress), otafit.py (a manifest's checks),
# otaman.py (manifest, abort, probe: loaded for one message), otatrial.py
# (a trial's check, kept while it runs), otastate.py (ota.json: the
# switch, the confirmation, the rollback: loaded for them).  Protocol and
# layout: device/README.md, "Over-the-air updates".
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
import gc
import json
import time

from micropython import const

from . import codec, unload
from .node import NET_ERRORS

_SEP = const((",", ":"))
# bytes of data a chunk may carry (the "n" of need): umqtt takes a message in
# one allocation, and on a board's fragmented heap 1 kB was the one that failed
_CHUNK = const(512)


def state():
    from . import otastate

    return otastate


def dl():
    from . import otadl  # while a download is in progress (dropped for the others)

    return otadl


class Ota:
    def __init__(self, dev):
        self.dev = dev
        self.want = None  # [file, offset] wanted next
        self.n = 0  # sha256 failures of this download in this boot
        self.first = None  # seq of this boot's first reading (trial)
        self.t = time.ticks_ms()
        # dev.stats["connects"] of the session greeted (with need, trial): not
        # this one when a message of it loaded the receiver (it gets its answer)
        self.connects = dev.stats["connects"] if dev._client is not None else -1
        try:
            cfg = dev.cfg
            self.topic = codec.topic(cfg.topic_prefix, cfg.device_id, "up", "ota").encode()
            from . import otafit

            self.st = otafit.load()
            self.m = otafit.find(self.st)  # the manifest being downloaded (with its "slot"), or None
            unload("otafit")
            otafit = None
            if self.m is not None:
                dl().resume(self)
        except MemoryError:
            unload("otafit")  # and this module: nothing would drop it (node.py's _ota stays None)
            unload("otadl")
            unload("ota")
            raise

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
        c = dev._client
        if c is not None and dev.stats["connects"] != self.connects:
            self.connects = dev.stats["connects"]  # a new session: say where the board is
            tr = st.get("trial")
            if tr is not None:
                self.send({"id": tr["id"], "st": "trial", "v": st.get("v")})
            else:
                if self.want is None and self.m is not None:
                    dl().resume(self)  # one the heap refused before: the download goes on
                self.need()
        if "trial" in st:
            from . import otatrial  # kept while the trial runs (dropped with this module)

            otatrial.trial(self)  # confirmed, or out of time
        if c is None:
            return
        rep = st.get("rep")
        if rep is not None and self.send(rep):
            st.pop("rep", None)
            state().write(st)
            unload("otastate")
        if "trial" not in st and "rep" not in st and self.m is None:
            dev._ota = None  # nothing pending: drop this code (heap)
            unload("otatrial")
            unload("otadl")
            unload("ota")

    def handle(self, msg):
        i = msg.find(b"\n")
        try:
            doc = _doc(msg, i)
            t = doc["t"]
        except (ValueError, KeyError, TypeError):
            t = None
        if t == "c" and i > 0:
            m = self.m
            if m is not None and doc.get("id") == m["id"]:
                dl().write(self, doc, memoryview(msg)[i + 1 :])
                return
            t = "q"  # a stray chunk: say where the board is
        if t not in ("m", "x", "q"):
            self.dev.stats["bad_messages"] += 1
            self.dev.log("ota: bad message")
            return
        self.rare(msg, i, t)

    def rare(self, msg, i, t):
        """A manifest, an abort or a probe (its own function: a function's
        code is one block, and a fragmented heap has small ones)."""
        # one module at a time (the download's, otafit's, otaman's), each
        # loaded before the message is parsed (again): the parse's small
        # objects, scattered over the free heap, left no block for their
        # code on a 64k board; and a local name keeps a module as sys.modules does
        unload("otadl")
        why = doc = None
        if t == "m":
            gc.collect()
            from . import otafit

            try:
                why = otafit.fit(_doc(msg, i))  # None: the board can take it
            finally:
                unload("otafit")
                otafit = None
        gc.collect()
        from . import otaman

        doc = _doc(msg, i)
        msg = None
        try:
            t = otaman.handle(self, t, doc, why)
        finally:
            unload("otaman")
            otaman = doc = None
        if t and dl().resume(self):  # a new download, or the same again: what is on flash, what to ask
            self.need()

    # -- replies ----------------------------------------------------------------
    def need(self):
        w = self.want
        if w is not None:
            self.send({"id": self.m["id"], "st": "need", "f": w[0], "o": w[1], "n": _CHUNK})

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


def _doc(msg, i):
    """The JSON line that starts a down/ota message."""
    return json.loads(msg if i < 0 else msg[:i])
