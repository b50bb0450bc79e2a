"""The pure modules under the real MicroPython Unix port (not only CPython):
the ring buffer against a list model with power cuts, sequence blocks,
backoff bounds and the command codec, in an ESP32-sized heap."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.micropython import ESP32_HEAP, Flash, require_micropython, run_script

pytestmark = pytest.mark.micropython

SCRIPT = r"""
import json, random
from iggy_device.ring import Ring
from iggy_device.seq import Sequence
from iggy_device.backoff import Backoff
from iggy_device import codec, commands

random.seed(SEED)
ring = Ring("r", 1024, 256, 4)
model = []
delivered = []
dropped = 0
nid = 0
for step in range(500):
    op = random.getrandbits(8)
    if op < 128:
        lost = ring.append("ch", json.dumps({"i": nid, "p": "x" * (op % 50)}))
        model = model[lost:]
        dropped += lost
        model.append(nid)
        nid += 1
    elif op < 220:
        rec = ring.peek()
        if not model:
            assert rec is None
        else:
            assert json.loads(rec[1])["i"] == model[0], (rec, model[0])
            ring.pop()
            delivered.append(model.pop(0))
    else:
        ring._close_reader()  # power cut: nothing flushed
        ring = Ring("r", 1024, 256, 4)
        extra = len(ring) - len(model)
        assert 0 <= extra < 4, extra
        if extra:
            model = delivered[-extra:] + model
    assert len(ring) == len(model), (len(ring), len(model))
    assert ring.dropped == dropped
    assert ring.bytes_used() <= 1024

s = Sequence("seq", 8)
got = [s.next() for _ in range(20)]
assert got == list(range(20)) and s.writes == 3
assert Sequence("seq", 8).next() == 24

b = Backoff(100, 1000)
for _ in range(30):
    d = b.next_ms()
    assert 50 <= d <= 1000, d

assert commands.parse_command(b'{"id":"a","name":"n","args":{"x":1}}') == ("a", "n", {"x": 1}, None)
assert json.loads(codec.encode_reading(3, None, {"t": 1})) == {"seq": 3, "t": 1}
print("OK", nid, len(delivered), dropped)
"""


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pure_modules_under_micropython(tmp_path: Path, seed: int) -> None:
    require_micropython()
    r = run_script(SCRIPT.replace("SEED", str(seed)), Flash(tmp_path), heapsize=ESP32_HEAP)
    assert r.returncode == 0, r.stdout + r.stderr
    ok, appended, delivered, dropped = r.stdout.split()
    assert ok == "OK"
    assert int(appended) > 0
    assert int(delivered) > 0
    assert int(dropped) > 0  # the scenario does overflow the ring
