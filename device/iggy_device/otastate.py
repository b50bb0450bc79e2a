# Over-the-air updates (issue 21): the state on flash, shared by the loader
# (otaboot.py, at every boot) and the receiver (ota.py).  Loaded only when
# needed and dropped again (heap).  Layout (device/README.md, "Over-the-air
# updates"):
#   ota.json    {"cur": "a", "v": "1.2", ...}: the one file whose rename is
#               the switch.  Keys: cur/v the running slot and version;
#               prev/pv the slot and version to go back to while a trial
#               runs; trial {"id", "boots"}; rep, a report not yet PUBACKed
#               ({"id", "st": "done" | "rolled_back", "v", "why"}); id the
#               update last confirmed, rb [id, why] the one last rolled
#               back; n, t: the trial's bounds (boots, seconds of one boot).
#   s/a/, s/b/  the two slots (app files, optionally lib/iggy_device/);
#               the staging slot is the one that is not "cur"
#   s/m.json    the manifest of a download in progress (with its slot)
#   fatal.txt   the last uncaught error; a rollback writes its reason here
# A board without ota.json runs slot "a" (provisioning wrote it).  Loaded
# in a trial, for an update's rare steps, and for failures; then dropped.
# Pure: json + fsutil (a reset through boot.py).
# Names (heap): every distinct name and every string of at most 10
# characters is a qstr, and on a 32-bit board the library, umqtt and the
# app fill 5 qstr pools (620 names): a 6th costs ~4.7 kB.  So the OTA
# modules reuse names the library already has (load, write, find, done,
# rewind, boot, fatal, reset), their constants are const() (no qstr: an int,
# or a str object), and messages are built with one long format string.
import json

from micropython import const

from . import fsutil

_STATE = const("ota.json")
_N_BOOTS = const(3)  # trial boots without confirmation before the rollback
_SEP = const((",", ":"))
_JOIN = const("%s: %s")
_IMPORT = const("import: ")
# T: 300 s, what one trial boot may run without confirmation (ota.py)


def load():
    raw = fsutil.read(_STATE)
    if raw:
        try:
            st = json.loads(raw)
            if isinstance(st, dict) and st.get("cur") in ("a", "b"):
                return st
        except ValueError:
            pass
    return {"cur": "a"}


def write(st):
    fsutil.write_atomic(_STATE, json.dumps(st, separators=_SEP).encode())


def boot():
    """The loader, at a trial boot: count it, and roll back when the trial
    has used its boots (before anything of it runs).  Returns whether the
    trial goes on."""
    st = load()
    tr = st.get("trial")
    if tr is None:
        return False
    n = tr["boots"] = tr.get("boots", 0) + 1
    if n <= st.get("n", _N_BOOTS):
        write(st)
        print("[iggy] ota: trial boot %d of %d of %s" % (n, st.get("n", _N_BOOTS), st.get("v")))
        return True
    rewind(st, "not confirmed in %d boots" % (n - 1), True)
    return False


def done(st):
    """The trial confirmed itself."""
    tr = st.pop("trial")
    st.pop("prev", None)
    st.pop("pv", None)
    st["id"] = tr["id"]
    st["rep"] = {"id": tr["id"], "st": "done", "v": st.get("v")}
    write(st)


def rewind(st, why, raw=False, dev=None):
    """Roll back to the previous slot (the same atomic rename); the reason
    (with ``raw``: and the last uncaught error, fatal.txt) goes to fatal.txt
    and into the report the old version sends once connected.  With ``dev``
    (the trial ran out of time in this boot) the board resets; at boot the
    loader goes on with the old slot."""
    if raw:
        raw = fsutil.read("fatal.txt")
        if raw:
            try:
                why = _JOIN % (why, raw.decode())
            except UnicodeError:
                pass
    tr = st.pop("trial")
    why = why[:200]
    prev = st.pop("prev", None)
    if prev is not None:
        st["cur"] = prev
        st["v"] = st.pop("pv", None)
    st["rb"] = [tr["id"], why]
    st["rep"] = {"id": tr["id"], "st": "rolled_back", "v": st.get("v"), "why": why}
    try:
        fsutil.write_atomic("fatal.txt", why.encode())
    except OSError:
        pass  # a full flash: the report still carries it
    write(st)
    why = "rolled back to %s - %s" % (st.get("v"), why)
    if dev is None:
        print("[iggy] ota:", why)
    else:
        reset(dev, why)


def staged(o, m):
    """Every file of ``m`` is in the staging slot, its sha256 checked: say
    so, switch (the one atomic step of an update: the slot becomes the
    running one, in trial), reset into the trial."""
    o.send({"id": m["id"], "st": "staged", "v": m["v"]})
    o.m = o.want = None  # what shutdown() still handles is answered "trial"
    st = o.st
    st["prev"] = st["cur"]
    st["pv"] = st.get("v")
    st["cur"] = m["slot"]
    st["v"] = m["v"]
    st["trial"] = {"id": m["id"], "boots": 0}
    st.pop("rep", None)  # the gateway has moved on to this update
    fsutil.remove("fatal.txt")  # what a rollback reports is this trial's error, not an older one
    write(st)  # the atomic step
    fsutil.remove("s/m.json")
    reset(o.dev, "switched to " + m["v"])


def reset(dev, why):
    """``dev``'s session ends (shutdown), then the board resets; None:
    at once (the loader: nothing runs yet)."""
    if dev is not None:
        dev.log("ota: %s - reset" % why)
        dev.shutdown()
    from . import boot  # the hardware (machine) is boot.py's and hw.py's

    boot.machine.reset()


def fatal(e, trial):
    """The app's entry module raised at import (SyntaxError, ImportError,
    any exception): in a trial that is a failed trial, rolled back at once
    (and reset, so the old version starts in a clean interpreter);
    otherwise the library's last resort (fatal.txt, reset in 10 s)."""
    if trial:
        st = load()
        if "trial" in st:
            rewind(st, _IMPORT + repr(e))
            reset(None, None)
    from . import boot

    boot.fatal(e, None, False)
