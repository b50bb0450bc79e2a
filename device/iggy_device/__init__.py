# iggy_device: a small MicroPython library that speaks the iggy-edge MQTT
# conventions.  Import the parts you need (``from iggy_device.node import
# Device``); this file stays empty so that importing one pure module does not
# drag the MQTT client into RAM.
VERSION = "0.1.0"


def unload(name):
    """Forget the boot-only submodule ``name`` (configcheck, datadir, devinit), so
    the garbage collector takes its code and tables: sys.modules and this
    package are what keep a module alive."""
    import sys

    sys.modules.pop("iggy_device." + name, None)
    d = globals()
    if name in d:
        del d[name]
