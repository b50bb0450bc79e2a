# Over-the-air updates: the loader's boot step (otaboot.py), loaded for it
# and dropped before the app starts.  Reads ota.json without otastate.py
# (which is loaded only in a trial or for a failure: heap).  Its few short
# strings are const() (no qstr: otastate.py says why).
import gc
import sys

from micropython import const

from . import fsutil

_MAIN = const(("/main.py", "/main.mpy"))
_SLOT = const("s/")
_LIB = const("/lib")


def run():
    """Safe mode: None.  Otherwise the running slot goes first on sys.path
    (a trial boot counted first) and this returns whether a trial runs."""
    if fsutil.exists("safe"):
        print("[iggy] safe mode: /safe exists - not starting")
        return None
    raw = fsutil.read("ota.json")
    trial = raw is not None and b'"trial"' in raw
    if trial:
        from . import otastate, unload

        trial = otastate.boot()  # False: rolled back
        otastate = None
        unload("otastate")
        raw = fsutil.read("ota.json")
    slot = "a"
    if raw:
        import json

        try:
            slot = json.loads(raw)["cur"]
        except (ValueError, KeyError, TypeError):
            pass  # otastate.load() reads it the same way: slot a
    slot = _SLOT + slot
    if not (fsutil.exists(slot + _MAIN[0]) or fsutil.exists(slot + _MAIN[1])):
        from . import otastate

        otastate.fatal(ImportError("no main.py in " + slot), trial)  # resets
    sys.path.insert(0, slot + _LIB)
    sys.path.insert(0, slot)
    if fsutil.exists(slot + _LIB + "/iggy_device"):
        for k in list(sys.modules):  # the app's library is the slot's own
            if k.startswith("iggy_device"):
                del sys.modules[k]
    gc.collect()
    return trial
