from __future__ import annotations

import sys

from tests.support.micropython import DEVICE_DIR, EXAMPLES_DIR

# The pure device modules run under CPython too: make them importable the
# way MicroPython sees them on a board (/lib/iggy_device, /bme280.py).
for p in (str(DEVICE_DIR), str(EXAMPLES_DIR / "env_sensor")):
    if p not in sys.path:
        sys.path.insert(0, p)
