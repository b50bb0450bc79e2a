"""Failures a real deployment meets (issue 10: points 3, 4, 6 and 8), each
reproduced under the real MicroPython Unix port with the real umqtt.simple,
against a real Mosquitto where the network is involved.  Only hardware is
stood in for (tests/device/stubs): a DHT22 that answers with checksum
errors, an ADC that fails, RTC memory that survives the watchdog and
machine.reset(), input pins, the watchdog's start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.downlink.commands import Command

from tests.support.broker import Broker
from tests.support.micropython import (
    DEEPSLEEP_EXIT,
    ESP32_HEAP,
    Board,
    Flash,
    MqttLog,
    board_config,
    require_micropython,
    run_script,
    unique_device_id,
)
from tests.support.tmpfs import small_tmpfs

pytestmark = pytest.mark.micropython

RESET_EXIT = 77  # tests/device/stubs/machine.py: machine.reset()
WDT_RESET = 3


@pytest.fixture(autouse=True)
def _needs_micropython() -> None:
    require_micropython()


def _logged(broker: Broker, tmp_path: Path, dev: str) -> MqttLog:
    return MqttLog(broker, f"edge/{dev}/#", tmp_path, f"sub-{dev}")


# -- 3. DHT22 checksum errors ----------------------------------------------------
def test_dht22_checksum_errors_are_counted_and_the_sensor_keeps_running(
    broker: Broker, tmp_path: Path
) -> None:
    dev = unique_device_id("dht")
    log = _logged(broker, tmp_path, dev)
    try:
        flash = Flash(tmp_path / "flash")
        flash.install_example(
            "env_sensor",
            **board_config(broker.host, broker.port, dev, period_ms=0, cycles=12, app={"dht_pin": 4}),
        )
        # the probe read fails with a checksum error too: the sensor is there
        plan = ["checksum", "ok", "ok", "checksum", "ok", "ok"]
        flash.path("_hw_dht.txt").write_text(" ".join(plan))
        board = Board(flash).start()
        assert board.wait(60) == 0, board.console()[-3000:]
        done = board.done()
        assert done["cycles"] == 12
        # measure() call 0 is the probe, calls 1..12 the readings, cycling
        # through the plan: checksum errors at calls 3, 6, 9 and 12
        expected_errors = sum(1 for i in range(1, 13) if plan[i % 6] == "checksum")
        assert done["sensor_errors"] == expected_errors == 4
        log.wait_for(lambda m: len(m.json("/up/env")) >= 12 - expected_errors, 20, "the good readings")
        env = log.json("/up/env")
        assert len(env) == 12 - expected_errors
        assert all(d["temp_c"] == 21.5 and "sim" not in d for d in env)  # the DHT, not simulated
        assert "sensor: DHT22" in board.console()
        assert "checksum error" in board.console()
    finally:
        log.stop()


# -- 4. the last-resort guard --------------------------------------------------------
def test_battery_sensor_deep_sleeps_after_an_uncaught_error(broker: Broker, tmp_path: Path) -> None:
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "battery_sensor",
        **board_config(
            broker.host, broker.port, unique_device_id("batt"), period_ms=60000, upload_every=1, awake_ms=100
        ),
    )
    flash.path("_hw_adc.txt").write_text("fail")  # the ADC read raises OSError
    board = Board(flash).start()
    rc = board.wait(30)
    console = board.console()
    assert rc == DEEPSLEEP_EXIT, console[-3000:]  # not left awake at the REPL
    assert "[iggy] fatal: OSError" in console
    assert flash.text("_hw_sleeps.log").split() == ["60000"]  # its normal period
    assert "OSError" in flash.text("fatal.txt")
    assert flash.text("_hw_rtc.bin") == ""  # no sequence number to resume from


def test_mains_board_resets_after_an_uncaught_error(broker: Broker, tmp_path: Path) -> None:
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "actuator", **board_config(broker.host, broker.port, unique_device_id("relay"), period_ms=100)
    )
    flash.path("relay.json").write_text("{torn")  # a file half-written at a power cut
    board = Board(flash).start()
    rc = board.wait(40)
    console = board.console()
    assert rc == RESET_EXIT, console[-3000:]  # machine.reset(), after the pause
    assert "[iggy] fatal: ValueError" in console
    assert "reset in 10 s" in console
    assert flash.text("_hw_reset") == "2"  # HARD_RESET for the next boot


def test_battery_sensor_has_an_awake_budget_and_skips_the_upload_after_hitting_it(
    broker: Broker, tmp_path: Path
) -> None:
    dev = unique_device_id("budget")
    log = _logged(broker, tmp_path, dev)
    try:
        flash = Flash(tmp_path / "flash")
        cfg = flash.install_example(
            "battery_sensor",
            **board_config(broker.host, broker.port, dev, period_ms=60000, upload_every=1, awake_ms=100),
        )
        assert cfg["awake_budget_ms"] > 0  # the example's template sets one
        board = Board(flash).start()
        assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
        # the budget is a watchdog started once and never fed (the stand-in
        # logs every WDT started; a fed one would be wdt_ms)
        assert flash.text("_hw_wdt.log").split() == [str(cfg["awake_budget_ms"])]
        log.wait_for(lambda m: len(m.json("/up/battery")) == 1, 10, "the first upload")
        # the next wake is a watchdog reset (the budget ran out: a hang);
        # RTC memory survives it, as on an ESP32
        flash.path("_hw_reset").write_text(str(WDT_RESET))
        board.start()
        assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
        assert board.console().count("[iggy] connected to") == 1  # no second connect
        assert "no upload this wake" in board.console()
        assert flash.text("_hw_sleeps.log").split() == ["60000", "60000"]
    finally:
        log.stop()


def test_low_battery_reports_once_then_uploads_rarely(broker: Broker, tmp_path: Path) -> None:
    dev = unique_device_id("lowbatt")
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "battery_sensor",
        **board_config(broker.host, broker.port, dev, period_ms=60000, upload_every=1, awake_ms=100),
    )
    flash.path("_hw_adc.txt").write_text("10000")  # about 950 mV: far below low_mv
    board = Board(flash)
    connects = []
    for _ in range(8):
        board.start()
        assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
        connects.append(board.console().count("[iggy] connected to"))
    # upload_every 1 would connect at every wake; low: once at once, then
    # every 4th wake (low_upload_every defaults to 4 x upload_every)
    per_wake = [b - a for a, b in zip([0, *connects], connects, strict=False)]
    assert per_wake == [1, 0, 0, 1, 0, 0, 0, 1], per_wake
    assert board.console().count("battery low") == 1


# -- 6. re-provisioning: safe mode, device id change ---------------------------------
@pytest.mark.parametrize("how", ["file", "pin"])
def test_safe_mode_starts_nothing_and_no_watchdog(broker: Broker, tmp_path: Path, how: str) -> None:
    flash = Flash(tmp_path / "flash")
    extra: dict[str, Any] = {"safe_pin": 0} if how == "pin" else {}
    flash.install_example(
        "env_sensor",
        **board_config(broker.host, broker.port, unique_device_id("safe"), period_ms=0, cycles=5, **extra),
    )
    if how == "file":
        flash.path("safe").write_text("")
    else:
        flash.path("_hw_inputs.txt").write_text("0 0\n")  # BOOT held down
    board = Board(flash).start()
    assert board.wait(30) == 0, board.console()[-3000:]
    console = board.console()
    assert "[iggy] safe mode:" in console
    assert "IGGY-DONE" not in console  # the example did not run
    assert flash.text("_hw_wdt.log") == ""  # a started WDT would outlive a soft reset
    assert not flash.path("data").exists()
    # without the marker it runs as usual
    if how == "file":
        flash.path("safe").unlink()
    else:
        flash.path("_hw_inputs.txt").write_text("0 1\n")
    board.start()
    assert board.wait(60) == 0, board.console()[-3000:]
    assert board.done()["cycles"] == 5


def test_a_new_device_id_does_not_publish_the_old_ids_data(broker: Broker, tmp_path: Path) -> None:
    old, new = unique_device_id("old"), unique_device_id("new")
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "env_sensor",
        **board_config(
            broker.host,
            broker.port,
            old,
            period_ms=0,
            cycles=6,
            wifi_timeout_ms=50,
            backoff_base_ms=60000,
            backoff_max_ms=60000,
        ),
    )
    flash.path("_hw_wifi_down").write_text("")  # the old board buffered 6 readings offline
    board = Board(flash).start()
    assert board.wait(60) == 0, board.console()[-3000:]
    assert board.done()["buffered"] == 6
    flash.path("_hw_wifi_down").unlink()
    # re-provisioned under a new id (config.json rewritten, data/ left)
    log = _logged(broker, tmp_path, new)
    try:
        flash.install_example(
            "env_sensor", **board_config(broker.host, broker.port, new, period_ms=0, cycles=3)
        )
        board.start()
        assert board.wait(60) == 0, board.console()[-3000:]
        log.wait_for(lambda m: len(m.json("/up/env")) >= 3, 20, "the new id's readings")
        env = log.json("/up/env")
        assert len(env) == 3  # not the 6 the old id buffered
        seqs = [d["seq"] for d in env] + [d["seq"] for d in log.json("/up/diag")]
        assert sorted(seqs) == list(range(len(seqs)))  # a fresh sequence for a new identity
        assert f"data: belonged to '{old}'" in board.console()
        assert flash.text("data/owner") == new
    finally:
        log.stop()


# -- 8. smaller ones ---------------------------------------------------------------
CONFIG_CHECKS = r"""
from iggy_device import config
def refused(**kw):
    base = {"device_id": "d-1", "broker": "10.0.0.2"}
    base.update(kw)
    try:
        config.Config(base)
    except config.ConfigError as e:
        return str(e)
    return None
print("K0", refused(keepalive=0))
print("K65536", refused(keepalive=65536))
print("K65535", refused(keepalive=65535))
print("ID", refused(device_id="k\u00fchlschrank"))
print("USER", refused(user="b\u00e4r", password="x"))
c = config.Config({"device_id": "d-1", "broker": "10.0.0.2"})
print("NTP", c.ntp_host)
print("NTP2", config.Config({"device_id": "d-1", "broker": "b", "ntp_host": "ntp.lan"}).ntp_host)
print("RING", c.ring_bytes, c.segment_bytes)
"""


def test_config_refuses_bad_keepalive_and_non_ascii_ids_and_ntp_defaults_to_the_broker(
    tmp_path: Path,
) -> None:
    r = run_script(CONFIG_CHECKS, Flash(tmp_path), heapsize=ESP32_HEAP)
    assert r.returncode == 0, r.stdout + r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert "keepalive" in out["K0"]
    assert "keepalive" in out["K65536"]
    assert out["K65535"] == "None"
    assert "device_id must be ASCII" in out["ID"]
    assert "user must be ASCII" in out["USER"]
    assert out["NTP"] == "10.0.0.2"  # an isolated LAN has no pool.ntp.org
    assert out["NTP2"] == "ntp.lan"


def test_default_ring_holds_a_day_of_env_sensor_at_10s(broker: Broker, tmp_path: Path) -> None:
    """Bytes per buffered env reading measured in the ring's files, times
    8,640 (a day at 10 s), against the ring the example gets by default."""
    flash = Flash(tmp_path / "flash")
    cfg = flash.install_example(
        "env_sensor",
        **board_config(
            broker.host, broker.port, unique_device_id("ring"), period_ms=0, cycles=200, wifi_timeout_ms=50
        ),
    )
    flash.path("_hw_wifi_down").write_text("")
    board = Board(flash).start()
    assert board.wait(60) == 0, board.console()[-3000:]
    used = sum(p.stat().st_size for p in (flash.root / "data" / "ring").glob("*.seg"))
    per_reading = used / 200
    # sequence numbers grow to 4 digits over a day: allow for the longer lines
    day = (per_reading + 3) * 8640
    assert cfg["ring_bytes"] >= day, (cfg["ring_bytes"], per_reading)
    assert cfg["ring_bytes"] <= 1536 * 1024  # the ESP32's 2 MB filesystem holds it with room to spare


def test_corrupt_sequence_file_is_reported_in_diagnostics(broker: Broker, tmp_path: Path) -> None:
    dev = unique_device_id("seqrec")
    log = _logged(broker, tmp_path, dev)
    try:
        flash = Flash(tmp_path / "flash")
        flash.install_example(
            "env_sensor", **board_config(broker.host, broker.port, dev, period_ms=0, cycles=3)
        )
        (flash.root / "data").mkdir()
        flash.path("data/seq").write_text("\x00\x00garbage")
        board = Board(flash).start()
        assert board.wait(60) == 0, board.console()[-3000:]
        assert board.done()["seq_recovered"] == 1
        log.wait_for(lambda m: len(m.json("/up/diag")) >= 1, 20, "a diag message")
        assert log.json("/up/diag")[0]["seq_recovered"] == 1
    finally:
        log.stop()


def test_expires_at_reaches_the_board_as_integer_seconds() -> None:
    """A float expiry is float32 on an ESP32: 1.7e9 rounds to 128 s steps."""
    cmd = Command("c1", "d1", "set", {}, created_at=1_700_000_000.75, expires_at=1_700_000_300.9)
    doc = json.loads(cmd.device_payload())
    assert doc["expires_at"] == 1_700_000_300
    assert isinstance(doc["expires_at"], int)
    assert isinstance(doc["created_at"], int)


def test_ring_is_shrunk_to_the_free_flash_and_says_so(broker: Broker, tmp_path: Path) -> None:
    """A 1 MiB default ring on a filesystem with 512 KiB: shrunk at boot,
    logged, and the bound holds while readings pile up offline."""
    with small_tmpfs(tmp_path / "fs", "512k") as fs:
        flash = Flash(fs / "flash")
        flash.install_example(
            "env_sensor",
            **board_config(
                broker.host,
                broker.port,
                unique_device_id("small"),
                period_ms=0,
                cycles=50,
                wifi_timeout_ms=50,
                segment_bytes=4096,
            ),
        )
        flash.path("_hw_wifi_down").write_text("")
        board = Board(flash).start()
        assert board.wait(60) == 0, board.console()[-3000:]
        line = next(x for x in board.console().splitlines() if "does not fit" in x)
        got = int(line.rsplit("using", 1)[1])
        assert got % 4096 == 0
        assert 4096 * 2 <= got <= 512 * 1024 - 65536
        assert board.done()["dropped"] == 0


AWAKE_BUDGET = r"""
import time
from iggy_device.hw import Hardware
hw = Hardware(wdt_ms=0, budget_ms=BUDGET)
time.sleep_ms(150)
hw.feed()  # a fed watchdog would be late here: the stand-in exits 76
print("NOT-FED")
"""


@pytest.mark.parametrize(("budget", "fed"), [(100, False), (0, True)])
def test_the_awake_budget_watchdog_is_never_fed(tmp_path: Path, budget: int, fed: bool) -> None:
    code = AWAKE_BUDGET.replace("BUDGET", str(budget))
    if fed:  # the ordinary watchdog, for contrast: fed late, it resets the board
        code = code.replace("wdt_ms=0", "wdt_ms=100")
    r = run_script(code, Flash(tmp_path))
    if fed:
        assert r.returncode == 76, r.stdout + r.stderr
    else:
        assert r.returncode == 0, r.stdout + r.stderr
        assert "NOT-FED" in r.stdout
