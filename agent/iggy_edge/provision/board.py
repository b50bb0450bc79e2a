"""What the board runs: the MicroPython snippets `device flash` and
`device provision` send with `mpremote exec`, and the probe's answer read
back on the host."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .layout import CLEAR_SLOTS, SLOT, app_name
from .sources import LIBRARY_PACKAGE

# what the board runs to say what it is (also the first step of provisioning)
# (and whether the firmware has the library frozen in: looked up in the
# firmware alone, '.frozen' on sys.path, which MicroPython 1.21+ searches
# before /lib, so a copy there would never be imported)
PROBE = (
    "import sys, json\n"
    "try:\n"
    "    import umqtt.simple\n"
    "    u = 1\n"
    "except ImportError:\n"
    "    u = 0\n"
    "p = sys.path[:]\n"
    "sys.path[:] = ['.frozen']\n"
    "try:\n"
    f"    import {LIBRARY_PACKAGE} as m\n"
    "    f = getattr(m, 'VERSION', '?')\n"
    "except Exception:\n"  # not in the firmware (or broken there): provisioning copies ours
    "    f = None\n"
    "sys.path[:] = p\n"
    "print('IGGY-PROBE', json.dumps({'impl': sys.implementation.name, 'platform': sys.platform, "
    "'version': list(sys.implementation.version[:3]), 'mpy': getattr(sys.implementation, '_mpy', 0), "
    "'umqtt': u, 'frozen': f}))\n"
)


@dataclass(frozen=True)
class Probe:
    """What a MicroPython board says about itself (PROBE's output)."""

    impl: str
    platform: str
    version: tuple[int, ...]
    mpy: int  # sys.implementation._mpy: .mpy version | feature flags << 8
    umqtt: bool
    frozen: str | None = None  # the version of the library frozen into the firmware, if any

    @property
    def mpy_version(self) -> int:
        return self.mpy & 0xFF


def parse_probe(output: str) -> Probe | None:
    for line in output.splitlines():
        if line.startswith("IGGY-PROBE "):
            doc = json.loads(line[len("IGGY-PROBE ") :])
            return Probe(
                impl=str(doc["impl"]),
                platform=str(doc["platform"]),
                version=tuple(int(x) for x in doc["version"]),
                mpy=int(doc["mpy"]),
                umqtt=bool(doc["umqtt"]),
                frozen=None if doc.get("frozen") is None else str(doc["frozen"])[:40],
            )
    return None


# Safe mode: with /safe on the board the examples start nothing at boot
# (iggy_device.boot.safe_mode), in particular no watchdog: on ESP32 a soft reset
# (what mpremote does) does not stop a started machine.WDT, so a board running
# an example would hard-reset in the middle of the copy.  Provisioning writes
# /safe, hard-resets (which does stop the watchdog), copies, and removes it.
# It also removes main.py (the copy brings the new one): a board still
# running a library from before safe mode existed would otherwise start its
# example, and its watchdog, again after the reset.
SAFE_ON = (
    "import os\nf = open('safe', 'w')\nf.close()\ntry:\n    os.remove('main.py')\nexcept OSError:\n    pass\n"
)
SAFE_OFF = "import os\nos.remove('safe')\n"
# MicroPython imports x.py before x.mpy: the old library goes first, as
# source and as bytecode, and so do both forms of the example's modules.
_REMOVE = (
    "import os\n"
    "def rm(p):\n"
    "    try:\n"
    "        os.remove(p)\n"
    "    except OSError:\n"
    "        pass\n"
    "try:\n"
    "    for n in os.listdir('lib/{pkg}'):\n"
    "        rm('lib/{pkg}/' + n)\n"
    "except OSError:\n"
    "    pass\n"
    "for n in {names!r}:\n"
    "    rm(n)\n"
)


def remove_old_snippet(files: dict[str, Path]) -> str:
    """The board-side code that deletes the previous library and both forms
    (.py, .mpy) of every example module about to be copied (at the root,
    where a board before over-the-air updates has them); with the slot
    layout (layout.py) also what earlier updates left."""
    names = []
    for board_path in sorted(files):
        name = app_name(board_path)
        if name is None or name == "main.py":
            continue
        stem, dot, ext = name.rpartition(".")
        if dot and ext in ("py", "mpy"):
            names += [f"{stem}.py", f"{stem}.mpy"]
    slots = any(p.startswith(SLOT + "/") for p in files)
    return _REMOVE.format(pkg=LIBRARY_PACKAGE, names=names) + (CLEAR_SLOTS if slots else "")


# {pkg}: LIBRARY_PACKAGE
MKDIRS = (
    "import os\n"
    "for d in ('lib', 'lib/{pkg}', 's', 's/a'):\n"
    "    try:\n"
    "        os.mkdir(d)\n"
    "    except OSError:\n"
    "        pass\n"
)
