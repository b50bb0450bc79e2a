# Over-the-air updates: the rare messages (manifest, abort, probe), loaded by
# ota.py for one of them and dropped again (heap).  The manifest has been
# checked by otafit.py before (loaded for that and dropped: the two are never
# on the heap together).  Names are few and reused from the library,
# constants const() (heap: otastate.py says why).
import json

from micropython import const

from . import fsutil

_MARGIN = const(32768)  # flash that stays free once the staging slot is full
_SEP = const((",", ":"))
_S = const("s/")  # the slots' directory
_ABORTED = const("aborted")
_BAD_ID = const("bad manifest: id")  # otafit.fit's verdict on an id


def handle(o, t, doc, why):
    """``o``: the receiver (ota.Ota); ``t``: "m", "x" or "q"; ``why``: for a
    manifest, otafit.fit's verdict (None: the board can take it).  True: a
    download starts or goes on (``o.m`` set; the receiver loads otadl.py
    and resumes from what is on flash).  In small functions: each one's code is one block, and a
    fragmented heap has small ones."""
    st = o.st
    uid = doc.get("id")
    if t == "q" or "trial" in st:
        # a probe; or anything while a trial runs (switched: too late to
        # abort, and the previous slot must stay as it is for the rollback)
        probe(o, t, uid)
        return False
    if t == "x":
        if o.m is not None and uid in (None, o.m["id"]):
            drop(o)
        refuse(o, uid, _ABORTED)
        return False
    if uid is not None and uid == st.get("id"):
        o.send({"id": uid, "st": "done", "v": st.get("v")})  # applied already
        return False
    rb = st.get("rb")
    if rb and rb[0] == uid:
        o.send({"id": uid, "st": "rolled_back", "v": st.get("v"), "why": rb[1]})
        return False
    if why is not None:
        refuse(o, None if why == _BAD_ID else uid, why)  # an id that is not one is not echoed
        return False
    m = o.m
    if m is not None and m["id"] == uid and m["files"] == doc["files"] and m["v"] == doc["v"]:
        return True  # the same update again (after a reconnect): go on from what is on flash
    return start(o, doc, uid)


def probe(o, t, uid):
    """A probe, or any message while a trial runs: where the board is."""
    st = o.st
    tr = st.get("trial")
    if tr is not None:
        if t == "m" and tr["id"] != uid:
            refuse(o, uid, "busy: trial of " + str(st.get("v")))
        else:
            o.send({"id": tr["id"], "st": "trial", "v": st.get("v")})
    elif o.want is not None:
        o.need()
    else:
        import sys

        mpy = getattr(sys.implementation, "_mpy", None)  # the gateway checks its .mpy files early
        mpy = None if mpy is None else mpy & 0xFF
        o.send({"id": st.get("id"), "st": "idle", "v": st.get("v"), "mpy": mpy})


def start(o, doc, uid):
    """A new download: the staging slot emptied, room checked, s/m.json."""
    drop(o)  # another download, or leftovers: the staging slot starts empty
    slot = "b" if o.st["cur"] == "a" else "a"  # the staging slot: not the running one
    free = None
    try:
        import os

        free = os.statvfs(".")
        free = free[0] * free[4]  # f_bsize * f_bavail, as datadir.fit
    except (AttributeError, OSError):
        free = None
    if free is not None and doc["total"] + _MARGIN > free:
        refuse(o, uid, "no space: %d bytes, %d free" % (doc["total"], free))
        return False
    fsutil.makedirs(_S + slot)
    m = {"id": uid, "v": doc["v"], "files": doc["files"], "slot": slot}
    fsutil.write_atomic("s/m.json", json.dumps(m, separators=_SEP))  # a str: one block, not two
    o.m = m
    o.n = 0
    o.dev.log("ota: update %s to %s, %d bytes" % (uid, doc["v"], doc["total"]))
    return True


def refuse(o, i, why):
    """The update ``i`` (its id) failed (refused, aborted): say why."""
    if o.m is not None and o.m["id"] == i:
        drop(o)
    o.dev.log("ota: failed:", why)
    o.send({"id": i, "st": "failed", "why": why[:200]})


def drop(o):
    """Forget the download: the staging slot is emptied (it never ran)."""
    fsutil.remove("s/m.json")
    o.m = o.want = None
    remove_tree(_S + ("b" if o.st["cur"] == "a" else "a"))


def remove_tree(path):
    import os

    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        p = path + "/" + name
        if not fsutil.remove(p):
            remove_tree(p)
    try:
        os.rmdir(path)
    except OSError:
        pass
