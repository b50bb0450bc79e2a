# The fixed loader of a board with over-the-air updates (issue 21).  The
# board's /main.py is these two lines, written by provisioning and never
# updated over the air:
#
#     from iggy_device import otaboot
#     otaboot.run()
#
# otapick.py picks the running slot from ota.json (a trial boot is
# counted, and a trial that used its boots rolled back, by otastate.py
# before anything of the trial runs) and puts the slot (and the slot's
# lib/, for an update that brings the library) first on sys.path; then the
# slot's ``main`` (main.py or main.mpy: the app as provisioning would copy
# it, calling ``hw.start(main)``) is imported.  This frame stays below the
# app's for as long as the board runs, so this module is only that: the
# rest is loaded for boot and dropped.
import sys


def run():
    from . import otapick, unload

    trial = otapick.run()  # None: safe mode
    otapick = None
    unload("otapick")  # sys.modules and the package's attribute: both keep it alive
    if trial is None:
        return
    try:
        __import__("main")
    except Exception as e:  # noqa: BLE001 - SyntaxError, ImportError, anything at import
        del sys.path[:2]  # the slot: what handles it is the board's own library
        for k in list(sys.modules):
            if k.startswith("iggy_device") or k.startswith("main"):
                del sys.modules[k]
        from . import otastate

        otastate.fatal(e, trial)
