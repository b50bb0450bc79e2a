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
import json

from . import fsutil

STATE = "ota.json"
MANIFEST = "s/m.json"
FATAL = "fatal.txt"
N_BOOTS = 3  # trial boots without confirmation before the rollback
T_S = 300  # seconds one trial boot may run without confirmation
_SEP = (",", ":")


def load():
    raw = fsutil.read(STATE)
    if raw:
        try:
            st = json.loads(raw)
            if isinstance(st, dict) and st.get("cur") in ("a", "b"):
                return st
        except ValueError:
            pass
    return {"cur": "a"}


def save(st):
    fsutil.write_atomic(STATE, json.dumps(st, separators=_SEP).encode())


def slot_dir(name):
    return "s/" + name


def other(name):
    return "b" if name == "a" else "a"


def count_boot():
    """The loader, at a trial boot: count it, and roll back when the trial
    has used its boots (before anything of it runs).  Returns whether the
    trial goes on."""
    st = load()
    tr = st.get("trial")
    if tr is None:
        return False
    tr["boots"] = tr.get("boots", 0) + 1
    if tr["boots"] <= st.get("n", N_BOOTS):
        save(st)
        print("[iggy] ota: trial boot", tr["boots"], "of", st.get("n", N_BOOTS), "of", st.get("v"))
        return True
    why = "not confirmed in " + str(tr["boots"] - 1) + " boots"
    last = fsutil.read(FATAL)
    if last:
        try:
            why += ": " + last.decode()
        except UnicodeError:
            pass
    roll_back(st, why)
    print("[iggy] ota: rolled back to", st.get("v"), "-", why)
    return False


def switch(st, slot, uid, v):
    """The one atomic step of an update: ``slot`` (complete, every file's
    sha256 checked) becomes the running one, in trial."""
    st["prev"] = st["cur"]
    st["pv"] = st.get("v")
    st["cur"] = slot
    st["v"] = v
    st["trial"] = {"id": uid, "boots": 0}
    st.pop("rep", None)  # the gateway has moved on to this update
    fsutil.remove(FATAL)  # what a rollback reports is this trial's error, not an older one
    save(st)


def confirm(st):
    tr = st.pop("trial")
    st.pop("prev", None)
    st.pop("pv", None)
    st["id"] = tr["id"]
    st["rep"] = {"id": tr["id"], "st": "done", "v": st.get("v")}
    save(st)


def roll_back(st, why):
    """Back to the previous slot (same atomic rename); the reason goes to
    fatal.txt and into the report the old version sends once connected."""
    tr = st.pop("trial")
    why = why[:200]
    prev = st.pop("prev", None)
    if prev is not None:
        st["cur"] = prev
        st["v"] = st.pop("pv", None)
    st["rb"] = [tr["id"], why]
    st["rep"] = {"id": tr["id"], "st": "rolled_back", "v": st.get("v"), "why": why}
    try:
        fsutil.write_atomic(FATAL, why.encode())
    except OSError:
        pass  # a full flash: the report still carries it
    save(st)


def on_flash(st):
    """The manifest of the download in progress (ota.py), or None; one
    left over from before a switch (or torn) is removed."""
    if not fsutil.exists(MANIFEST):
        return None
    m = None
    try:
        with open(MANIFEST) as f:
            m = json.load(f)  # from the stream: no copy of the file
        tr = st.get("trial")
        if m["slot"] == st["cur"] or (tr and tr["id"] == m["id"]):
            m = None  # switched before it was removed
    except (OSError, ValueError, KeyError, TypeError):
        m = None  # torn: the gateway sends the manifest again
    if m is None:
        fsutil.remove(MANIFEST)
    return m


def staged(o, m):
    """Every file of ``m`` is in the staging slot, its sha256 checked: say
    so, switch, reset into the trial."""
    o.reply({"id": m["id"], "st": "staged", "v": m["v"]})
    o.m = o.need = None  # what shutdown() still handles is answered "trial"
    switch(o.st, m["slot"], m["id"], m["v"])  # the atomic step
    fsutil.remove(MANIFEST)
    reset(o.dev, "switched to " + m["v"])


def fail_trial(o, why):
    """The running trial failed in this boot (no confirmation in time)."""
    last = fsutil.read(FATAL)
    if last:
        why += ": " + last.decode()
    roll_back(o.st, why)
    reset(o.dev, "rolled back to " + str(o.st.get("v")) + " - " + why)


def reset(dev, why):
    dev.log("ota:", why, "- reset")
    dev.shutdown()
    _reset()


def _reset():
    from . import boot  # the hardware (machine) is boot.py's and hw.py's

    boot.machine.reset()


def import_failed(err, trial):
    """The app's entry module raised at import (SyntaxError, ImportError,
    any exception): in a trial that is a failed trial, rolled back at once
    (and reset, so the old version starts in a clean interpreter);
    otherwise the library's last resort (fatal.txt, reset in 10 s)."""
    why = "import: " + repr(err)
    if trial:
        st = load()
        if "trial" in st:
            roll_back(st, why)
            print("[iggy] ota: rolled back to", st.get("v"), "-", why)
            _reset()
    from . import boot

    boot.fatal(err, None, False)
