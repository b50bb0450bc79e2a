"""Power cuts during an over-the-air update (issue 21): the board process is
SIGKILLed at random points of the download and of the switch, 20 times, one
update each.  It must always boot either the old or the new version, never a
mix of the two, and the update must then complete (or be reported failed).
Real MicroPython Unix port, real umqtt.simple, real Mosquitto; the gateway is
the contract's stand-in updater (tests/support/ota_sender.py)."""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Callable

import pytest

from tests.device.test_ota import OtaBoard, ota_board  # noqa: F401 - the fixture
from tests.support.ota_sender import app_files, booted_versions
from tests.support.wait import wait_until

pytestmark = [pytest.mark.micropython, pytest.mark.slow]

CUTS = 20


def _sha(d: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in d.items()}


def test_power_cuts_during_download_and_switch_boot_the_old_or_the_new_version_never_a_mix(
    ota_board: Callable[..., OtaBoard],  # noqa: F811 - the fixture imported above
) -> None:
    seed = int(os.environ.get("OTA_CUT_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    b = ota_board()
    running = "1"
    shipped = {"1": app_files("1")}
    where_cut: list[str] = []
    for i in range(CUTS):
        old, new = running, str(i + 2)
        files = app_files(new, pad=rng.choice([1000, 6000, 12000]))
        shipped[new] = files
        mark = len(b.console())
        s = b.send(new, files)
        where = rng.choice(["download", "download", "download", "staged", "trial"])
        if where == "download":
            # somewhere in the ~1-2 s the download takes (or just after)
            time.sleep(rng.uniform(0.0, 1.6))
        else:
            s.wait_state(where, 60)
        b.sup.power_cut()
        where_cut.append(f"{where}@{len(s.replies)}")
        r = s.wait_result(180)
        assert r["st"] in ("done", "failed"), (seed, i, r)
        if r["st"] == "done":
            running = new
        # each boot imported one version whole: the old or the new one
        booted = booted_versions(b.console()[mark:])
        assert booted, (seed, i)
        for main, lib in booted:
            assert main == lib, (seed, i, booted)
            assert main in (old, new), (seed, i, booted)
        assert booted[-1][0] == running, (seed, i, booted)
        # the running slot holds exactly that version's files
        wait_until(lambda: "rep" not in b.state() and "trial" not in b.state(), 20, what="report sent")
        st = b.state()
        assert st["v"] == running
        assert _sha(b.slot_files(st["cur"])) == _sha(shipped[running]), (seed, i)
        s.close()
        b.senders.remove(s)
    # a cut can cost a retry, not the update: every one completed here
    assert running == str(CUTS + 1), (seed, where_cut)
    assert "Traceback" not in b.console(), seed
