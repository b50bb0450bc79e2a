# The fixed loader of a board with over-the-air updates (issue 21).  The
# board's /main.py is these two lines, written by provisioning and never
# updated over the air:
#
#     from iggy_device import otaboot
#     otaboot.run()
#
# It picks the running slot from ota.json (a trial boot is counted, and a
# trial that used its boots rolled back, by otastate.py before anything of
# the trial runs), puts the slot (and the slot's lib/, for an update that
# brings the library) first on sys.path and imports the slot's ``main``
# (main.py or main.mpy: the app as provisioning would copy it, calling
# ``hw.start(main)``).  This frame stays below the app's for as long as the
# board runs, and what it loads stays in the heap's layout: so it is small,
# and otastate.py is loaded only in a trial or for a failure.
import gc
import sys

from . import fsutil


def run():
    if fsutil.exists("safe"):
        print("[iggy] safe mode: /safe exists - not starting")
        return
    raw = fsutil.read("ota.json")
    trial = raw is not None and b'"trial"' in raw
    if trial:
        from . import otastate

        trial = otastate.count_boot()  # False: rolled back
        otastate = None
        _forget("iggy_device.otastate")
        raw = fsutil.read("ota.json")
    slot = "s/a"
    if raw:
        import json

        try:
            slot = "s/" + json.loads(raw)["cur"]
        except (ValueError, KeyError, TypeError):
            pass  # otastate.load() reads it the same way: slot a
    if fsutil.exists(slot + "/main.py") or fsutil.exists(slot + "/main.mpy"):
        sys.path.insert(0, slot + "/lib")
        sys.path.insert(0, slot)
        if fsutil.exists(slot + "/lib/iggy_device"):
            _forget("iggy_device")  # the app's library is the slot's own
        raw = None
        gc.collect()
        try:
            __import__("main")
            return
        except Exception as e:  # noqa: BLE001 - SyntaxError, ImportError, anything at import
            err = e
        del sys.path[:2]  # what handles it is the board's own library
    else:
        err = ImportError("no main.py in " + slot)
    _forget("iggy_device")
    _forget("main")
    gc.collect()
    from . import otastate

    otastate.import_failed(err, trial)


def _forget(prefix):
    for k in list(sys.modules):
        if k.startswith(prefix):
            del sys.modules[k]
