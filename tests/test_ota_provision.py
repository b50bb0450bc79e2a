"""`device provision` writes the over-the-air layout when the library
brings its loader (provision/layout.py), and the flat one otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from iggy_edge.provision.board import MKDIRS, remove_old_snippet
from iggy_edge.provision.layout import LOADER, has_loader, module_name
from iggy_edge.provision.plan import build_plan
from iggy_edge.provision.sources import source_root
from iggy_edge.provision.staging import device_config, stage

from tests.support.micropython import Flash, require_micropython, run_script

REPO = source_root()


def _root_with_loader(tmp_path: Path) -> Path:
    """The sources, with the loader module the OTA library brings (a stub
    here: the device library's side is another branch)."""
    root = tmp_path / "src"
    shutil.copytree(REPO / "device", root / "device")
    shutil.copytree(REPO / "firmware_examples", root / "firmware_examples")
    (root / "device" / "iggy_device" / "otaboot.py").write_text("def run():\n    import main\n")
    return root


def _stage(root: Path, tmp_path: Path) -> dict[str, Path]:
    template = json.loads((root / "firmware_examples/env_sensor/config.json").read_text())
    cfg = device_config(template, "env-7", "lab", "10.0.0.2", 1883)
    return stage(root, "env_sensor", tmp_path / "staging", cfg, {"wifi_password": "x"}, mpy=False)


def test_with_the_loader_the_app_goes_to_slot_a_and_main_py_is_the_loader(tmp_path: Path) -> None:
    root = _root_with_loader(tmp_path)
    assert has_loader(root)
    files = _stage(root, tmp_path)
    assert files["main.py"].read_text() == LOADER
    state = json.loads(files["ota.json"].read_text())  # slot a, and a version to report
    assert state["cur"] == "a"
    assert state["v"].startswith("env_sensor-")
    assert {"s/a/main.py", "s/a/bme280.py", "config.json", "config.local.json"} <= set(files)
    assert "bme280.py" not in files
    plan = build_plan("/dev/ttyUSB0", files, tmp_path)
    assert any(s.args[-1] == ":s/a/" for s in plan.steps)
    assert "'s/a'" in MKDIRS


def test_without_the_loader_the_layout_stays_flat(tmp_path: Path) -> None:
    if has_loader(REPO):  # the OTA library is merged: the flat layout is for older ones
        (tmp_path / "old").mkdir()
        shutil.copytree(REPO / "device", tmp_path / "old" / "device")
        shutil.copytree(REPO / "firmware_examples", tmp_path / "old" / "firmware_examples")
        (tmp_path / "old" / "device" / "iggy_device" / "otaboot.py").unlink()
        root = tmp_path / "old"
    else:
        root = REPO
    files = _stage(root, tmp_path)
    assert "bme280.py" in files
    assert not any(p.startswith("s/") for p in files)
    assert "otaboot" not in files["main.py"].read_text()


def test_reprovisioning_clears_what_updates_left_and_the_old_flat_app(tmp_path: Path) -> None:
    require_micropython()
    files = _stage(_root_with_loader(tmp_path), tmp_path)
    flash = Flash(tmp_path / "board")
    for rel in (
        "ota.json",
        "s/m.json",
        "s/a/main.py",
        "s/b/main.mpy",
        "s/b/lib/iggy_device/node.mpy",
        "bme280.py",
    ):
        p = flash.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x = 1\n")
    (flash.root / "data").mkdir()
    (flash.root / "data" / "seq").write_text("64")
    (flash.root / "config.json").write_text("{}")
    r = run_script(remove_old_snippet(files), flash)
    assert r.returncode == 0, r.stdout + r.stderr
    left = sorted(str(p.relative_to(flash.root)) for p in flash.root.rglob("*") if p.is_file())
    assert left == ["_snippet.py", "config.json", "data/seq"]


def test_the_module_name_of_a_board_path_is_what_it_imports_as() -> None:
    assert module_name("lib/iggy_device/ota.py") == "iggy_device.ota"
    assert module_name("lib/iggy_device/__init__.mpy") == "iggy_device"
    assert module_name("lib/umqtt/simple.py") == "umqtt.simple"
    assert module_name("s/a/bme280.py") == "bme280"
    assert module_name("s/b/lib/iggy_device/node.py") == "iggy_device.node"
    assert module_name("bme280.py") == "bme280"


def test_bytecode_names_its_module_not_the_hosts_source_path(tmp_path: Path) -> None:
    """mpy-cross -s: the board interns a module's name anyway, a host path
    would be one more qstr per module (device/README.md, memory)."""
    template = json.loads((REPO / "firmware_examples/env_sensor/config.json").read_text())
    cfg = device_config(template, "env-7", "lab", "10.0.0.2", 1883)
    files = stage(REPO, "env_sensor", tmp_path / "staging", cfg, {}, mpy=True)
    ring = files["lib/iggy_device/ring.mpy"].read_bytes()
    assert b"iggy_device.ring" in ring
    assert str(REPO).encode() not in ring
    assert b"bme280" in files["s/a/bme280.mpy"].read_bytes()
    assert str(REPO).encode() not in files["s/a/bme280.mpy"].read_bytes()
