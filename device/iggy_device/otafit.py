# Over-the-air updates: the manifest's checks, loaded by ota.py for a
# manifest and dropped before otaman.py answers it (heap: the two together
# beside the app needed blocks a 64k board no longer had); and, when the
# receiver starts, ota.json and the manifest in progress (s/m.json).  Every
# input is untrusted, the gateway's too.  Constants const() (heap:
# otastate.py says why).
import json

from micropython import const

from . import fsutil

_MAX = const(262144)  # bytes of one update: the board's bound
_FILES = const(32)  # an app and the library (--with-library: 19 modules); a 32-file manifest is ~3.6 kB
_PATH = const(b"abcdefghijklmnopqrstuvwxyz0123456789_./-")
_ID = const(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_HEX = const(b"0123456789abcdef")
_ENTRY = const(("main.py", "main.mpy"))


def load():
    """ota.json (as otastate.load: otastate.py is not loaded for it, heap)."""
    raw = fsutil.read("ota.json")
    if raw:
        try:
            st = json.loads(raw)
            if isinstance(st, dict) and st.get("cur") in ("a", "b"):
                return st
        except ValueError:
            pass
    return {"cur": "a"}


def find(st):
    """The manifest of the download in progress (ota.py), or None; one
    left over from before a switch (or torn) is removed."""
    if not fsutil.exists("s/m.json"):
        return None
    m = None
    try:
        with open("s/m.json") as f:
            m = json.load(f)  # from the stream: no copy of the file
        tr = st.get("trial")
        if m["slot"] == st["cur"] or (tr and tr["id"] == m["id"]):
            m = None  # switched before it was removed
    except (OSError, ValueError, KeyError, TypeError):
        m = None  # torn: the gateway sends the manifest again
    if m is None:
        fsutil.remove("s/m.json")
    return m


def fit(doc):
    """None for a manifest the board can take, else the reason.  In small
    functions: each one's code is one block, and a fragmented heap has
    small ones."""
    if not _scan(doc.get("id"), _ID, 32):
        return "bad manifest: id"  # otaman.py's _BAD_ID
    v = doc.get("v")
    if not isinstance(v, str) or not 0 < len(v) <= 32:
        return "bad manifest: version"
    files = doc.get("files")
    if not isinstance(files, list) or not 0 < len(files) <= _FILES:
        return "bad manifest: 1..%d files" % _FILES
    total = 0
    seen = []
    for e in files:
        why = entry(e, seen)
        if why is not None:
            return why
        total += e[1]
    for e in _ENTRY:
        if e in seen:
            return tail(doc, total)
    return "bad manifest: no main.py"


def entry(e, seen):
    """None for a good file entry [path, size, sha256] (its path added to
    ``seen``), else the reason."""
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
    return None


def tail(doc, total):
    """The manifest's total and .mpy version."""
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
