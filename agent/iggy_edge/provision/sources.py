"""Where the device library and the examples are, and the host tools."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .errors import ProvisionError

LIBRARY_PACKAGE = "iggy_device"
PACKAGED_SOURCES = Path("/usr/share/iggy-edge")  # where the .deb puts device/ and firmware_examples/


def source_root(explicit: Path | None = None) -> Path:
    """The directory holding device/ and firmware_examples/: --source-root,
    IGGY_EDGE_DEVICE_ROOT, the checkout this module lives in, or the copy the
    Debian package installs."""
    candidates = [explicit] if explicit else []
    env = os.environ.get("IGGY_EDGE_DEVICE_ROOT")
    if env:
        candidates.append(Path(env))
    candidates += list(Path(__file__).resolve().parents)
    candidates.append(PACKAGED_SOURCES)
    for c in candidates:
        if c is not None and (c / "device" / LIBRARY_PACKAGE).is_dir() and (c / "firmware_examples").is_dir():
            return c
    raise ProvisionError(
        "cannot find device/ and firmware_examples/: pass --source-root or set IGGY_EDGE_DEVICE_ROOT"
    )


def examples(root: Path) -> list[str]:
    return sorted(p.parent.name for p in (root / "firmware_examples").glob("*/main.py"))


def tool(name: str) -> str:
    """A host tool from this interpreter's environment (the `device` extra), else PATH."""
    venv = Path(sys.executable).parent / name
    found = str(venv) if venv.exists() else shutil.which(name)
    if found is None:
        raise ProvisionError(
            f"{name} not found: install iggy-edge with the 'device' extra (pip install 'iggy-edge[device]')"
        )
    return found
