"""Where provisioning puts the app on the board: the over-the-air layout
(docs/ota.md) when the device library brings its loader, else the flat one.

With the loader (``iggy_device/otaboot.py`` in the library being installed):
``/main.py`` is the fixed two-line loader, never updated over the air; the
app's files go to slot ``/s/a/`` (the loader runs slot "a" on a board without
``ota.json``); config.json, its secrets and the CA certificate stay at the
root, the library in ``/lib/iggy_device/``.  Provisioning also clears what
an earlier update left (the staging manifest, both slots) and writes a
fresh ``ota.json`` (slot "a", the app's version: `default_version`), so the
board runs exactly what was provisioned and reports its version.  Without the loader (a library
from before over-the-air updates) the app goes to the root as it always did.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Final

from .sources import LIBRARY_PACKAGE

LOADER_MODULE: Final = "otaboot"
LOADER: Final = f"from {LIBRARY_PACKAGE} import {LOADER_MODULE}\n\n{LOADER_MODULE}.run()\n"
SLOT: Final = "s/a"
SLOTS: Final = ("s/a", "s/b")
OTA_STATE: Final = ("ota.json", "ota.json.tmp", "s/m.json")
STATE_FILE: Final = "ota.json"


def default_version(name: str, files: list[tuple[str, bytes]]) -> str:
    """``NAME-<8 hex>`` of an app's files (paths relative to the slot): what
    `device provision` records and `device update` sends by default, so the
    same files show as the same version."""
    digest = hashlib.sha256(b"".join(p.encode() + b"\0" + d for p, d in files)).hexdigest()
    return f"{name[:22]}-{digest[:8]}"


def ota_state(version: str) -> bytes:
    """The board's ota.json right after provisioning: slot "a", its version."""
    return json.dumps({"cur": "a", "v": version}, separators=(",", ":")).encode()


def has_loader(root: Path) -> bool:
    """Whether the library under `root` brings the over-the-air loader."""
    return (root / "device" / LIBRARY_PACKAGE / f"{LOADER_MODULE}.py").is_file()


def app_path(name: str, *, slots: bool) -> str:
    """Where an app file (``main.py``, ``bme280.mpy``) goes on the board."""
    return f"{SLOT}/{name}" if slots else name


def module_name(board_path: str) -> str:
    """The module a board path imports as (``lib/iggy_device/ota.py`` ->
    ``iggy_device.ota``, ``s/a/bme280.py`` -> ``bme280``): the source name
    given to mpy-cross (``-s``).  The board interns a module's name when it
    imports it, so that name as the .mpy's source file costs no qstr, where
    the host's path of the source costs one per module (about 30 on a board
    with an update running: a pool of qstrs more, ~4.7 kB on a 32-bit board).
    Tracebacks then name the module: ``File "iggy_device.ota", line 12``."""
    parts = board_path.split("/")
    if len(parts) > 2 and parts[0] == "s":
        parts = parts[2:]  # a slot's
    if len(parts) > 1 and parts[0] == "lib":
        parts = parts[1:]
    parts[-1] = parts[-1].rpartition(".")[0] or parts[-1]
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def app_name(board_path: str) -> str | None:
    """The app file's name of a board path (root or slot), None for others."""
    if board_path.startswith(SLOT + "/"):
        board_path = board_path[len(SLOT) + 1 :]
    return None if "/" in board_path else board_path


# Run on the board (mpremote exec) before copying a slot layout: the state
# of earlier updates and both slots' files go (subdirectories one level deep:
# a slot's lib/iggy_device/).
CLEAR_SLOTS: Final = (
    "import os\n"
    "def rm(p):\n"
    "    try:\n"
    "        os.remove(p)\n"
    "    except OSError:\n"
    "        pass\n"
    "def clear(d):\n"
    "    try:\n"
    "        names = os.listdir(d)\n"
    "    except OSError:\n"
    "        return\n"
    "    for n in names:\n"
    "        p = d + '/' + n\n"
    "        try:\n"
    "            os.remove(p)\n"
    "        except OSError:\n"
    "            clear(p)\n"
    "            try:\n"
    "                os.rmdir(p)\n"
    "            except OSError:\n"
    "                pass\n"
    f"for p in {OTA_STATE!r}:\n"
    "    rm(p)\n"
    f"for d in {SLOTS!r}:\n"
    "    clear(d)\n"
)
