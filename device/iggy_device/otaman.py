# Over-the-air updates: the rare messages (manifest, abort, probe), loaded by
# ota.py for one of them and dropped again (heap).  The manifest is checked
# here: every input is untrusted, the gateway's too.
import json

from . import fsutil, otastate

MAX_TOTAL = 262144  # bytes of one update: the board's bound
MAX_FILES = 32  # an app and the library (--with-library: 19 modules); a 32-file manifest is ~3.6 kB
MARGIN = 32768  # flash that stays free once the staging slot is full
_PATH = "abcdefghijklmnopqrstuvwxyz0123456789_./-"
_ID = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"
_HEX = "0123456789abcdef"


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
                fail(o, uid, "busy: trial of " + str(st.get("v")))
            else:
                o.reply({"id": tr["id"], "st": "trial", "v": st.get("v")})
        elif o.need is not None:
            o.reply_need()
        else:
            import sys

            mpy = getattr(sys.implementation, "_mpy", None)  # the gateway checks its .mpy files early
            o.reply(
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
        fail(o, uid, "aborted")
        return
    if uid is not None and uid == st.get("id"):
        o.reply({"id": uid, "st": "done", "v": st.get("v")})  # applied already
        return
    rb = st.get("rb")
    if rb and rb[0] == uid:
        o.reply({"id": uid, "st": "rolled_back", "v": st.get("v"), "why": rb[1]})
        return
    why = check(doc)
    if why is not None:
        fail(o, uid if _word(uid, _ID, 32) else None, why)
        return
    m = o.m
    if m is not None and m["id"] == uid and m["files"] == doc["files"] and m["v"] == doc["v"]:
        o.reply_need()  # the same update again (after a reconnect): go on
        return
    drop(o)  # another download, or leftovers: the staging slot starts empty
    slot = otastate.other(st["cur"])
    free = free_bytes()
    if free is not None and doc["total"] + MARGIN > free:
        fail(o, uid, "no space: " + str(doc["total"]) + " bytes, " + str(free) + " free")
        return
    fsutil.makedirs("s/" + slot)
    m = {"id": uid, "v": doc["v"], "files": doc["files"], "slot": slot}
    fsutil.write_atomic(otastate.MANIFEST, json.dumps(m, separators=(",", ":")).encode())
    o.m = m
    o.fails = 0
    o.dev.log("ota: update", uid, "to", doc["v"], doc["total"], "bytes")
    if o.resume():
        o.reply_need()


def fail(o, uid, why):
    if o.m is not None and o.m["id"] == uid:
        drop(o)
    o.dev.log("ota: failed:", why)
    o.reply({"id": uid, "st": "failed", "why": why[:200]})


def drop(o):
    """Forget the download: the staging slot is emptied (it never ran)."""
    fsutil.remove(otastate.MANIFEST)
    o.m = o.need = None
    remove_tree("s/" + otastate.other(o.st["cur"]))


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


def free_bytes():
    import os

    try:
        st = os.statvfs(".")
    except (AttributeError, OSError):
        return None
    return st[0] * st[4]  # f_bsize * f_bavail, as datadir.fit


def check(doc):
    """None for a manifest the board can take, else the reason."""
    if not _word(doc.get("id"), _ID, 32):
        return "bad manifest: id"
    v = doc.get("v")
    if not isinstance(v, str) or not 0 < len(v) <= 32:
        return "bad manifest: version"
    files = doc.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        return "bad manifest: 1.." + str(MAX_FILES) + " files"
    total = 0
    seen = []
    entry = False
    for e in files:
        if not isinstance(e, list) or len(e) != 3:
            return "bad manifest: file entry"
        p, n, h = e
        if not _word(p, _PATH, 96) or p[0] in "./" or p[-1] == "/" or ".." in p or "//" in p or "/." in p:
            return "bad manifest: path " + repr(p)[:40]
        if p in seen:
            return "bad manifest: " + p + " twice"
        seen.append(p)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TOTAL:
            return "bad manifest: size of " + p
        if not _word(h, _HEX, 64) or len(h) != 64:
            return "bad manifest: sha256 of " + p
        total += n
        entry = entry or p in ("main.py", "main.mpy")
    if not entry:
        return "bad manifest: no main.py"
    if doc.get("total") != total:
        return "bad manifest: total is not the sum of the sizes"
    if total > MAX_TOTAL:
        return "too big: " + str(total) + " > " + str(MAX_TOTAL) + " bytes"
    mpy = doc.get("mpy")
    if mpy is not None:
        import sys

        mine = getattr(sys.implementation, "_mpy", None)
        if not isinstance(mpy, int) or isinstance(mpy, bool):
            return "bad manifest: mpy"
        if mine is not None and mine & 0xFF != mpy:
            return "mpy version " + str(mpy) + ", the board loads " + str(mine & 0xFF)
    return None


def _word(s, chars, n):
    if not isinstance(s, str) or not 0 < len(s) <= n:
        return False
    for c in s:  # noqa: SIM110 - a generator for all() is one more allocation
        if c not in chars:
            return False
    return True
