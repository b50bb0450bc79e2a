# Over-the-air updates: the download (chunks into the staging slot, the
# sha256s, resume), loaded by ota.py while a download is in progress and
# dropped before otaman.py is loaded for a manifest, an abort or a probe, so
# the two never share the heap (heap: on a 32-bit board at 64k both beside
# the app found no block for otaman's code).  Names are few and reused from
# the library (heap: otastate.py says why).
from binascii import hexlify
from hashlib import sha256

from micropython import const

from . import fsutil, unload

_S = const("s")  # the slots' directory
_RETRIES = const(3)  # a file whose sha256 fails more often in one boot fails the update


def write(o, doc, data):
    """A chunk of the download ``o.m`` (its id checked by ota.py): ``data``
    of file ``f`` at offset ``o`` (straight from the message: no copy),
    appended once its sha256 is checked."""
    m = o.m
    f, at = doc.get("f"), doc.get("o")
    if o.want is None and not resume(o):  # after a step the heap refused: from the flash
        return
    if [f, at] != o.want:
        o.need()  # a duplicate or a late resend: ask for what is wanted
        return
    p, size, _ = m["files"][f]
    h = doc.get("h")
    n = len(data)
    if not n or at + n > size or not isinstance(h, str) or hexlify(sha256(data).digest()) != h.encode():
        o.dev.log("ota: chunk %d at %d refused (sha256 or size)" % (f, at))
        o.send({"id": m["id"], "st": "bad", "f": f, "o": at})
        return
    o.want = None  # until resume() has read the flash: never this chunk twice
    with open(path(o, p), "ab") as fh:
        fh.write(data)
    o.dev.hw.feed()
    if resume(o):
        o.need()


def path(o, p):
    return "%s/%s/%s" % (_S, o.m["slot"], p)


def resume(o):
    """Set ``o.want`` from what the staging slot holds; when every file is
    there and its sha256 checked, switch (and reset).  False: nothing
    to ask."""
    m = o.m
    files = m["files"]
    for i in range(len(files)):
        p, size, want = files[i]
        q = path(o, p)
        have = fsutil.size(q)
        if have < 0:
            if "/" in p:
                fsutil.makedirs(q.rpartition("/")[0])
            open(q, "wb").close()
            have = 0
        if have < size:
            o.want = [i, have]
            return True
        if have > size or digest(q) != want:
            fsutil.remove(q)
            o.n += 1
            o.dev.log("ota: %s sha256 does not match: fetching it again" % p)
            if o.n > _RETRIES:
                unload("otadl")  # not beside otaman: o.m is None after this
                from . import otaman

                otaman.refuse(o, m["id"], "sha256 of %s does not match" % p)
                unload("otaman")
                return False
            o.want = [i, 0]
            return True
        o.dev.hw.feed()
    from . import otastate

    otastate.staged(o, m)  # the switch; resets
    return False


def digest(p):
    """The sha256 (hex) of the file ``p``."""
    h = sha256()
    buf = bytearray(256)
    with open(p, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(buf if n == 256 else memoryview(buf)[:n])
    return hexlify(h.digest()).decode()
