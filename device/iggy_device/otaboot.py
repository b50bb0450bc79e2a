# The fixed loader of a board with over-the-air updates (issue 21).  The
# board's /main.py is these two lines, written by provisioning and never
# updated over the air:
#
#     from iggy_device import otaboot
#     otaboot.run()
#
# otastate.boot() picks the running slot from ota.json (a trial boot is
# counted, and a trial that used its boots rolled back, before anything of
# it runs), puts the slot (and the slot's lib/, for an update that brings
# the library) first on sys.path; then the slot's ``main`` (main.py or
# main.mpy: the app as provisioning would copy it, calling
# ``hw.start(main)``) is imported.  This frame stays below the app's for as
# long as the board runs, so it is small; otastate.py is dropped first.
import gc
import sys


def run():
    from . import otastate

    trial = otastate.boot()
    otastate = None
    if trial is None:
        return  # safe mode
    gc.collect()
    try:
        __import__("main")
    except Exception as e:  # noqa: BLE001 - SyntaxError, ImportError, anything at import
        del sys.path[:2]  # the slot: what handles it is the board's own library
        for k in list(sys.modules):
            if k == "main" or k.startswith("iggy_device"):
                del sys.modules[k]
        gc.collect()
        from . import otastate

        otastate.import_failed(e, trial)
