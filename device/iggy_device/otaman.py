# Over-the-air updates: the rare messages (manifest, abort, probe), loaded by
# ota.py for one of them and dropped again (heap).  The manifest is checked
# here: every input is untrusted, the gateway's too.  Names are few and
# reused from the library, constants const() (heap: otastate.py says why).
import json

from micropython import const

from . import fsutil

_MAX = const(262144)  # bytes of one update: the board's bound
_FILES = const(32)  # an app and the library (--with-library: 19 modules); a 32-file manifest is ~3.6 kB
_MARGIN = const(32768)  # flash that stays free once the staging slot is full
_PATH = const(b"abcdefghijklmnopqrstuvwxyz0123456789_./-")
_ID = const(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_HEX = const(b"0123456789abcdef")
_ENTRY = const(("main.py", "main.mpy"))
_SEP = const((",", ":"))
_S = const("s/")  # the slots' directory
_ABORTED = const("aborted")


def handle(o, t, doc):
    """``o``: the receiver (ota.Ota); ``t``: "m", "x" or "q"."""
    st = o.st
    uid = doc.get("id")
    tr = st.get("trial")
    if t == "q" or tr is not None:
        # a probe; or anything while a trial runs (switched: too late to
        # abort, and the previous slot must stay as it is for the rollback)
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
            o.send(
                {
                    "id": st.get("id"),
                    "st": "idle",
                    "v": st.get("v"),
                    "mpy": None if mpy is None else mpy & 0xFF,
                }
            )
        return
    if t == "x":
        if o.m is not None and uid in (None, o.m["id"]):
            drop(o)
        refuse(o, uid, _ABORTED)
        return
    if uid is not None and uid == st.get("id"):
        o.send({"id": uid, "st": "done", "v": st.get("v")})  # applied already
        return
    rb = st.get("rb")
    if rb and rb[0] == uid:
        o.send({"id": uid, "st": "rolled_back", "v": st.get("v"), "why": rb[1]})
        return
    why = fit(doc)
    if why is not None:
        refuse(o, uid if _scan(uid, _ID, 32) else None, why)
        return
    m = o.m
    if m is not None and m["id"] == uid and m["files"] == doc["files"] and m["v"] == doc["v"]:
        o.need()  # the same update again (after a reconnect): go on
        return
    drop(o)  # another download, or leftovers: the staging slot starts empty
    slot = "b" if st["cur"] == "a" else "a"  # the staging slot: not the running one
    free = None
    try:
        import os

        free = os.statvfs(".")
        free = free[0] * free[4]  # f_bsize * f_bavail, as datadir.fit
    except (AttributeError, OSError):
        free = None
    if free is not None and doc["total"] + _MARGIN > free:
        refuse(o, uid, "no space: %d bytes, %d free" % (doc["total"], free))
        return
    fsutil.makedirs(_S + slot)
    m = {"id": uid, "v": doc["v"], "files": doc["files"], "slot": slot}
    fsutil.write_atomic("s/m.json", json.dumps(m, separators=_SEP).encode())
    o.m = m
    o.n = 0
    o.dev.log("ota: update %s to %s, %d bytes" % (uid, doc["v"], doc["total"]))
    if o.resume():
        o.need()


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


def fit(doc):
    """None for a manifest the board can take, else the reason."""
    if not _scan(doc.get("id"), _ID, 32):
        return "bad manifest: id"
    v = doc.get("v")
    if not isinstance(v, str) or not 0 < len(v) <= 32:
        return "bad manifest: version"
    files = doc.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= _FILES:
        return "bad manifest: 1..%d files" % _FILES
    total = 0
    seen = []
    entry = False
    for e in files:
        if not isinstance(e, list) or len(e) != 3:
            return "bad manifest: file entry"
        p, n, h = e
        if not _scan(p, _PATH, 96):
            return "bad manifest: path " + repr(p)[:40]
        for s in p.split("/"):  # relative, no empty part, none starting with "."
            if not s or s.startswith("."):
                return "bad manifest: path " + repr(p)[:40]
        if p in seen:
            return "bad manifest: %s twice" % p
        seen.append(p)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _MAX:
            return "bad manifest: size of " + p
        if not _scan(h, _HEX, 64) or len(h) != 64:
            return "bad manifest: sha256 of " + p
        total += n
        entry = entry or p in _ENTRY
    if not entry:
        return "bad manifest: no main.py"
    if doc.get("total") != total:
        return "bad manifest: total is not the sum of the sizes"
    if total > _MAX:
        return "too big: %d > %d bytes" % (total, _MAX)
    mpy = doc.get("mpy")
    if mpy is not None:
        import sys

        mine = getattr(sys.implementation, "_mpy", None)
        if not isinstance(mpy, int) or isinstance(mpy, bool):
            return "bad manifest: mpy"
        if mine is not None and mine & 0xFF != mpy:
            return "mpy version %d, the board loads %d" % (mpy, mine & 0xFF)
    return None


def _scan(s, d, n):
    """``s`` is a str of 1..``n`` characters, each one of the bytes ``d``
    (its bytes: iterating a str makes a qstr of every character seen)."""
    if not isinstance(s, str) or not 0 < len(s) <= n:
        return False
    for c in s.encode():  # noqa: SIM110 - a generator for all() is one more allocation
        if c not in d:
            return False
    return True
