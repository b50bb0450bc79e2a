"""`iggy-edge device update` (build, request, status, cancel) against the
real agent and a real Mosquitto, the artifact build with the real
mpy-cross, and the version `device list` shows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from iggy_edge.cli.device_view import render
from iggy_edge.cli.main import app
from iggy_edge.devices import DeviceTable
from iggy_edge.ota.artifact import ArtifactError
from iggy_edge.ota.build import build
from iggy_edge.provision.sources import source_root
from typer.testing import CliRunner, Result

from tests.support.broker import Broker
from tests.support.ota_agent import ota_settings, rows, running, wait_state
from tests.support.ota_board import Script, ScriptedBoard
from tests.support.wait import async_wait_until

ROOT = source_root()
runner = CliRunner()


def _config(tmp_path: Path, broker: Broker) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'gateway_id = "gw-test"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        '[iggy]\nkind = "memory"\n[metrics]\nenabled = false\n'
    )
    return path


async def _cli(*args: str) -> Result:
    """The CLI in a thread: it is another process's work, the agent's loop goes on."""
    return await asyncio.to_thread(runner.invoke, app, list(args))


def test_an_example_builds_to_bytecode_with_main_py_as_source() -> None:
    art = build(ROOT, example="env_sensor")
    paths = [p for p, _ in art.files]
    assert "main.py" in paths
    assert "bme280.mpy" in paths
    assert "bme280.py" not in paths
    assert art.mpy == dict(art.files)["bme280.mpy"][1]
    lib = build(ROOT, example="env_sensor", with_library=True)
    assert "lib/iggy_device/node.mpy" in [p for p, _ in lib.files]
    # the module's name is the source name in the bytecode, not this host's path
    # (layout.module_name: one qstr less per module on the board)
    node = dict(lib.files)["lib/iggy_device/node.mpy"]
    assert b"iggy_device.node" in node
    assert str(ROOT).encode() not in node
    assert b"node.py" not in node
    assert str(ROOT).encode() not in dict(art.files)["bme280.mpy"]
    assert lib.id != art.id
    assert build(ROOT, example="env_sensor").id == art.id  # the same files: the same artifact


def test_a_bad_app_is_refused_with_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="unknown example"):
        build(ROOT, example="nope")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "helper.py").write_text("x = 1\n")
    with pytest.raises(ArtifactError, match=r"no main\.py"):
        build(ROOT, app_dir=tmp_path / "a")
    (tmp_path / "a" / "main.py").write_text("import helper\n")
    (tmp_path / "a" / "Big.py").write_text("x = 1\n")
    with pytest.raises(ArtifactError, match="must be 1-64 characters"):
        build(ROOT, app_dir=tmp_path / "a", mpy=False)
    (tmp_path / "a" / "Big.py").unlink()
    (tmp_path / "a" / "data.py").write_bytes(b"#" * (300 * 1024))
    with pytest.raises(ArtifactError, match="over the bound"):
        build(ROOT, app_dir=tmp_path / "a", mpy=False)
    (tmp_path / "a" / "bad.py").write_text("def (:\n")
    with pytest.raises(ArtifactError, match="mpy-cross failed"):
        build(ROOT, app_dir=tmp_path / "a")


async def test_device_update_installs_an_example_and_status_shows_it(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    cfg = _config(tmp_path, broker)
    async with running(settings):
        board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
        try:
            result = await _cli("device", "update", "-d", "dev-1", "--example", "env_sensor", "-c", str(cfg))
            assert result.exit_code == 0, result.output
            assert "1 of 1 board(s) updated" in result.output
        finally:
            await board.stop()
        assert "bme280.mpy" in board.flash.installed
        status = await _cli("device", "update", "status", "-c", str(cfg))
        assert status.exit_code == 0, status.output
        line = next(x for x in status.output.splitlines() if x.startswith("dev-1"))
        assert "done" in line
        assert "100%" in line
        assert board.flash.version in line
        doc = json.loads((await _cli("device", "update", "status", "--json", "-c", str(cfg))).output)
        assert doc["updates"][0]["board_version"] == board.flash.version


async def test_one_update_at_a_time_per_board_and_cancel(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    cfg = _config(tmp_path, broker)
    async with running(settings):
        board = await ScriptedBoard(broker.host, broker.port, "dev-1", script=Script(silent=True)).start()
        try:
            args = ("device", "update", "-d", "dev-1", "--example", "actuator", "--no-wait", "-c", str(cfg))
            first = await _cli(*args)
            assert first.exit_code == 0, first.output
            await wait_state(settings, "dev-1", "probing")
            second = await _cli(*args)
            assert second.exit_code == 1
            assert "already in progress on dev-1" in second.output
            cancel = await _cli("device", "update", "cancel", "-d", "dev-1", "-c", str(cfg))
            assert cancel.exit_code == 0, cancel.output
            await wait_state(settings, "dev-1", "cancelled")
            # the abort is published before the state is saved, and reaches
            # the board through the broker after it: wait for it, then check
            # that nothing (no probe retry) followed it
            abort = {"t": "x", "id": rows(settings)["dev-1"]["id"]}
            await async_wait_until(lambda: abort in board.received, 10, what="the abort on the board")
            await asyncio.sleep(0.5)
            assert board.received[-1] == abort
        finally:
            await board.stop()


def test_device_list_shows_the_app_version() -> None:
    table = DeviceTable()
    table.observe_group(
        [("edge/dev-1/up/diag", json.dumps({"lib": "0.9", "app_v": "env-1a2b3c4d"}).encode())]
    )
    (row,) = table.rows()
    assert row["app_v"] == "env-1a2b3c4d"
    row |= {"stale": False}
    assert "env-1a2b3c4d" in render({"devices": [row], "stale_after_s": 600})
    assert "env-1a2b3c4d" in render({"devices": [row], "stale_after_s": 600}, device="dev-1")
