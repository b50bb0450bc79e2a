# Over-the-air updates: the loader's boot step (otaboot.py), loaded for it
# and dropped before the app starts.  Reads ota.json without otastate.py
# (which is loaded only in a trial or for a failure: heap).
import gc
import sys

from . import fsutil


def pick():
    """Safe mode: None.  Otherwise the running slot goes first on sys.path
    (a trial boot counted first) and this returns whether a trial runs."""
    if fsutil.exists("safe"):
        print("[iggy] safe mode: /safe exists - not starting")
        return None
    raw = fsutil.read("ota.json")
    trial = raw is not None and b'"trial"' in raw
    if trial:
        from . import otastate, unload

        trial = otastate.count_boot()  # False: rolled back
        otastate = None
        unload("otastate")
        raw = fsutil.read("ota.json")
    slot = "s/a"
    if raw:
        import json

        try:
            slot = "s/" + json.loads(raw)["cur"]
        except (ValueError, KeyError, TypeError):
            pass  # otastate.load() reads it the same way: slot a
    if not (fsutil.exists(slot + "/main.py") or fsutil.exists(slot + "/main.mpy")):
        from . import otastate

        otastate.import_failed(ImportError("no main.py in " + slot), trial)  # resets
    sys.path.insert(0, slot + "/lib")
    sys.path.insert(0, slot)
    if fsutil.exists(slot + "/lib/iggy_device"):
        for k in list(sys.modules):  # the app's library is the slot's own
            if k.startswith("iggy_device"):
                del sys.modules[k]
    gc.collect()
    return trial
