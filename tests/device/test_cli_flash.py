"""`iggy-edge device flash` and the re-provisioning steps of `device
provision` (issue 10 point 6 and "Flashing").

What runs here for real: esptool's own CLI (`image-info` on image files
built to the ESP image format, and against a serial port where no chip
answers), mpremote against a missing port, and every snippet provisioning
runs on the board, under the MicroPython Unix port (probe, safe mode on,
removal of the old library).  What only a board can show: erase and write
through the ROM bootloader, the board's reset, its first boot.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from esptool import targets
from iggy_edge.cli import device
from iggy_edge.provision import ProvisionError
from iggy_edge.provision import plan as provision_plan
from iggy_edge.provision.board import PROBE, SAFE_OFF, SAFE_ON, Probe, parse_probe, remove_old_snippet
from iggy_edge.provision.flash import FlashError, Image, check_image, classify, esptool_argv, parse_chip
from iggy_edge.provision.plan import PROBE_LABEL, build_plan, copy_to_board
from iggy_edge.provision.sources import source_root, tool
from iggy_edge.provision.staging import check_mpy, device_config, prepare, stage
from typer.testing import CliRunner

from tests.support import frozen
from tests.support.broker import Broker
from tests.support.micropython import (
    MPLIB_DIR,
    Board,
    Flash,
    mpy_cross,
    mpy_cross_binary,
    require_micropython,
    run_script,
)
from tests.support.staging import stage_env_sensor

ESP32_CHIP_ID = 0
ESP32S3_CHIP_ID = 9


def esp_image(chip_id: int, payload: bytes = b"MicroPython v1.24.1 on 2024-11-29; Generic ESP32") -> bytes:
    """An application image in Espressif's format (header, extended header
    with the chip id, two segments, XOR checksum, SHA-256), what a firmware
    .bin starts with.  Built here from the format's description, so esptool
    can read it; the payload stands in for the firmware's banner."""
    data = payload + b"\0" * (-len(payload) % 4)
    segs = [(0x3FFB0000, b"\0" * 32), (0x40080000, data)]
    head = struct.pack("<BBBBI", 0xE9, len(segs), 2, 0x20, 0x40080000)  # DIO, 4MB @ 40 MHz
    head += struct.pack("<B3sHBHH4sB", 0xEE, b"\0\0\0", chip_id, 0, 0, 0xFFFF, b"\0" * 4, 1)
    body = head
    checksum = 0xEF
    for addr, seg in segs:
        body += struct.pack("<II", addr, len(seg)) + seg
        for b in seg:
            checksum ^= b
    body += b"\0" * (15 - len(body) % 16) + bytes([checksum])
    return body + hashlib.sha256(body).digest()


def _esptool() -> str:
    return tool("esptool")


# -- image checks with the real esptool --------------------------------------------
def test_a_valid_esp32_micropython_image_is_accepted_with_its_offset(tmp_path: Path) -> None:
    img = tmp_path / "ESP32_GENERIC-20241129-v1.24.1.bin"
    img.write_bytes(esp_image(ESP32_CHIP_ID))
    image = check_image(_esptool(), img)
    assert (image.chip, image.label, image.offset) == ("esp32", "ESP32", 0x1000)
    s3 = tmp_path / "ESP32_GENERIC_S3.bin"
    s3.write_bytes(esp_image(ESP32S3_CHIP_ID))
    image = check_image(_esptool(), s3)
    assert (image.chip, image.label, image.offset) == ("esp32s3", "ESP32-S3", 0x0)


def test_bad_images_are_refused_with_where_to_get_one(tmp_path: Path) -> None:
    esptool = _esptool()
    with pytest.raises(FlashError, match=r"no firmware image at .*micropython\.org/download"):
        check_image(esptool, tmp_path / "missing.bin")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"<html>404 Not Found</html>" * 10)  # a failed download
    with pytest.raises(FlashError, match=r"not an ESP firmware image.*magic"):
        check_image(esptool, junk)
    damaged = bytearray(esp_image(ESP32_CHIP_ID))
    damaged[60] ^= 0xFF  # a flipped byte inside a segment
    bad = tmp_path / "damaged.bin"
    bad.write_bytes(bytes(damaged))
    with pytest.raises(FlashError, match=r"damaged .*invalid.*download it again"):
        check_image(esptool, bad)
    other = tmp_path / "arduino.bin"
    other.write_bytes(esp_image(ESP32_CHIP_ID, b"some other firmware"))
    with pytest.raises(FlashError, match="ESP32 image but not MicroPython"):
        check_image(esptool, other)


def test_esptool_command_lines(tmp_path: Path) -> None:
    img = tmp_path / "fw.bin"
    esp32 = Image(img, "esp32", "ESP32")
    ident, erase, write = esptool_argv("esptool", "/dev/ttyUSB0", esp32)
    assert ident == ["esptool", "--port", "/dev/ttyUSB0", "read-mac"]
    assert erase == ["esptool", "--chip", "esp32", "--port", "/dev/ttyUSB0", "erase-flash"]
    assert write == [
        *["esptool", "--chip", "esp32", "--port", "/dev/ttyUSB0", "--baud", "460800"],
        *["write-flash", "0x1000", str(img)],
    ]
    c3 = Image(img, "esp32c3", "ESP32-C3")
    assert esptool_argv("esptool", "/dev/ttyACM0", c3)[2][-2] == "0x0"
    # every subcommand and option exists in the installed esptool
    for argv in (ident, erase, write):
        sub = next(a for a in argv if a in ("read-mac", "erase-flash", "write-flash"))
        r = subprocess.run([_esptool(), sub, "--help"], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
    top = subprocess.run([_esptool(), "--help"], capture_output=True, text=True, check=True).stdout
    assert all(opt in top for opt in ("--chip", "--port", "--baud"))


@pytest.mark.unit
def test_chip_and_probe_parsing() -> None:
    # esptool 5's banner (esptool/__init__.py: "Connected to {CHIP_NAME} on {port}:")
    assert parse_chip("Connecting....\nConnected to ESP32-S3 on /dev/ttyACM0:\n") == "ESP32-S3"
    assert parse_chip("Connecting...\nDetecting chip type... ESP32\n") == "ESP32"
    assert parse_chip("nothing") is None
    wrong = classify("/dev/x", "A fatal error occurred: This chip is ESP32-S3, not ESP32. Wrong")
    assert "the board is an ESP32-S3 but the image is for ESP32" in str(wrong)


def test_flash_where_no_chip_answers_real_esptool(tmp_path: Path, pty: Path) -> None:
    img = tmp_path / "ESP32_GENERIC.bin"
    img.write_bytes(esp_image(ESP32_CHIP_ID))
    result = CliRunner().invoke(device.app, ["flash", "--port", str(pty), "--firmware", str(img)])
    assert result.exit_code == 1
    assert "MicroPython image for ESP32 (written at 0x1000)" in result.output
    assert f"no ESP chip answers on {pty}" in result.output
    assert "BOOT" in result.output


def test_flash_missing_port_and_bad_image_fail_before_esptool_touches_a_board(tmp_path: Path) -> None:
    img = tmp_path / "ESP32_GENERIC.bin"
    img.write_bytes(esp_image(ESP32_CHIP_ID))
    result = CliRunner().invoke(device.app, ["flash", "--port", "/dev/ttyIGGYNOPE0", "--firmware", str(img)])
    assert result.exit_code == 1
    assert "no board on /dev/ttyIGGYNOPE0" in result.output
    result = CliRunner().invoke(
        device.app, ["flash", "--port", "/dev/ttyIGGYNOPE0", "--firmware", str(tmp_path / "nope.bin")]
    )
    assert result.exit_code == 1
    assert "micropython.org/download" in result.output


# -- provisioning's board-side steps, under the real Unix port ---------------------------
def _staged(tmp_path: Path, *, mpy: bool) -> dict[str, Path]:
    root = source_root()
    template = json.loads((root / "firmware_examples/env_sensor/config.json").read_text())
    cfg = device_config(template, "env-7", "lab", "10.0.0.2", 1883)
    return stage(root, "env_sensor", tmp_path / "staging", cfg, {"wifi_password": "x"}, mpy=mpy)


@pytest.mark.unit
def test_plan_enters_safe_mode_removes_the_old_library_and_leaves_safe_mode_last(tmp_path: Path) -> None:
    files = _staged(tmp_path, mpy=False)
    plan = build_plan("/dev/ttyUSB0", files, tmp_path)
    labels = [s.label for s in plan.steps]
    assert labels[:5] == [
        PROBE_LABEL,
        "enter safe mode (/safe)",
        "reset into safe mode (stops the watchdog)",
        "remove the old library",
        "create /lib",
    ]
    assert labels[-3:] == [
        "verify files on the board (sha256)",
        "leave safe mode",
        "reset to start the example",
    ]
    assert plan.steps[2].args == ("reset",)
    assert any(s.args[:1] == ("mip",) for s in plan.steps)
    frozen = build_plan("/dev/ttyUSB0", files, tmp_path, install_umqtt=False)
    assert not any(s.args[:1] == ("mip",) for s in frozen.steps)


def test_the_removal_snippet_deletes_old_source_and_bytecode_on_the_board(tmp_path: Path) -> None:
    require_micropython()
    flash = Flash(tmp_path / "board")
    lib = flash.root / "lib" / "iggy_device"
    lib.mkdir(parents=True)
    for name in ("node.py", "node.mpy", "gone_module.py", "ring.mpy"):
        (lib / name).write_text("x = 1\n")
    for name in ("bme280.py", "bme280.mpy", "main.py", "notes.txt"):
        (flash.root / name).write_text("x = 1\n")
    (flash.root / "data").mkdir()
    (flash.root / "data" / "seq").write_text("64")
    r = run_script(remove_old_snippet(_staged(tmp_path, mpy=True)), flash)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in lib.iterdir()) == []
    left = sorted(p.name for p in flash.root.iterdir() if not p.name.startswith("_"))
    assert left == ["data", "lib", "main.py", "notes.txt"]  # main.py is overwritten by the copy


def test_safe_mode_written_by_provisioning_stops_the_example_at_boot(tmp_path: Path) -> None:
    require_micropython()
    flash = Flash(tmp_path / "board")
    flash.install_example("env_sensor", device_id="env-7", broker="127.0.0.1", wdt_ms=5000, cycles=3)
    main = flash.path("main.py").read_bytes()
    r = run_script(SAFE_ON, flash)
    assert r.returncode == 0, r.stdout + r.stderr
    assert flash.path("safe").exists()
    # nothing to start after the reset, whatever library the board had
    assert not flash.path("main.py").exists()
    flash.path("main.py").write_bytes(main)  # what the copy step brings
    board = Board(flash).start()
    assert board.wait(30) == 0
    assert "[iggy] safe mode: /safe exists" in board.console()
    assert not flash.path("_hw_wdt.log").exists()  # no watchdog to fight the copy
    r = run_script(SAFE_OFF, flash)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not flash.path("safe").exists()


def test_probe_under_micropython_reports_mpy_version_and_umqtt(tmp_path: Path) -> None:
    require_micropython()
    r = run_script(PROBE, Flash(tmp_path / "with"))
    probe = parse_probe(r.stdout)
    assert probe is not None, r.stdout + r.stderr
    assert probe.impl == "micropython"
    assert probe.umqtt  # on the path, as when frozen into the firmware
    assert probe.frozen is None  # the library is not in this firmware
    bare = Flash(tmp_path / "bare")
    (bare.root / "lib").mkdir(parents=True)  # a /lib without umqtt
    probe_bare = parse_probe(run_script(PROBE, bare).stdout)
    assert probe_bare is not None
    assert not probe_bare.umqtt
    # the board's .mpy version against what mpy-cross makes here
    if mpy_cross_binary() is None:
        pytest.fail("mpy-cross is not installed (run .ci/setup)")
    src = tmp_path / "m.py"
    src.write_text("x = 1\n")
    mpy_cross(src, tmp_path / "m.mpy")
    files = {"lib/iggy_device/m.mpy": tmp_path / "m.mpy"}
    check_mpy(probe, files)  # this Unix port loads this mpy-cross's output
    old = Probe("micropython", "esp32", (1, 18, 0), 5, True)
    with pytest.raises(ProvisionError, match=r"loads \.mpy version 5, but mpy-cross here makes version 6"):
        check_mpy(old, files)
    check_mpy(old, {"main.py": src})  # no bytecode: nothing to check


# -- the whole provisioning flow against a board's filesystem -----------------------------
class FlashBoard:
    """What `run_mpremote` reaches, for a board that is a Flash directory:
    `exec` runs the code under the real MicroPython Unix port in it, `fs cp`
    and `fs sha256sum` act on its files, `mip install umqtt.simple` puts the
    real umqtt there, `reset` is recorded.  Only the serial transport is
    replaced (no raw REPL on the Unix port); this sits at our own wrapper."""

    def __init__(self, flash: Flash, firmware: str | None = None) -> None:
        self.flash = flash
        self.firmware = firmware  # a build with the library frozen in (tests/support/frozen.py)
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: list[str], port: str, timeout: float = 0) -> str:
        args = tuple(argv[3:])
        self.calls.append(args)
        root = self.flash.root
        if args[0] == "exec":
            r = run_script(args[1], self.flash, firmware=self.firmware)
            if r.returncode != 0:
                raise ProvisionError("mpremote failed: " + (r.stdout + r.stderr).strip()[-200:])
            return r.stdout
        if args == ("reset",):
            return ""
        if args[:2] == ("fs", "cp"):
            dest = args[-1][1:]
            for src in args[2:-1]:
                shutil.copyfile(src, root / dest / Path(src).name)
            return ""
        if args == ("mip", "install", "umqtt.simple"):
            shutil.copytree(MPLIB_DIR / "umqtt", root / "lib" / "umqtt", dirs_exist_ok=True)
            return ""
        if args[:2] == ("fs", "sha256sum"):
            out = []
            for p in args[2:]:
                out += [f"sha256sum {p}", hashlib.sha256((root / p[1:]).read_bytes()).hexdigest()]
            return "\n".join(out) + "\n"
        raise AssertionError(f"unexpected mpremote call {args}")


@pytest.mark.parametrize("umqtt_on_board", [True, False])
def test_provisioning_flow_on_a_used_board_then_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broker: Broker, umqtt_on_board: bool
) -> None:
    require_micropython()
    flash = Flash(tmp_path / "board")
    # a used board: an example running with a watchdog, an old library as
    # source that would shadow the new bytecode, an old module of the example
    flash.install_example("env_sensor", device_id="old-1", broker="127.0.0.1", wdt_ms=30000)
    old_lib = flash.root / "lib" / "iggy_device"
    old_lib.mkdir(parents=True)
    (old_lib / "__init__.py").write_text("")
    (old_lib / "node.py").write_text("raise ImportError('the old library ran')\n")
    if umqtt_on_board:
        shutil.copytree(MPLIB_DIR / "umqtt", flash.root / "lib" / "umqtt")  # as if frozen
    staging = tmp_path / "staging"
    staged = stage_env_sensor(staging, monkeypatch, "env-new", broker.port, mpy=True)
    fake = FlashBoard(flash)
    monkeypatch.setattr(provision_plan, "run_mpremote", fake)
    copy_to_board("mpremote", "/dev/ttyUSB0", staged, staging)
    assert (("mip", "install", "umqtt.simple") in fake.calls) is not umqtt_on_board
    resets = [i for i, c in enumerate(fake.calls) if c == ("reset",)]
    assert len(resets) == 2
    assert resets[-1] == len(fake.calls) - 1  # nothing talks to the started example
    assert not flash.path("safe").exists()
    assert not (old_lib / "node.py").exists()
    assert (old_lib / "node.mpy").exists()
    # the board boots into the new example (cycles shortened for the test)
    cfg = json.loads(flash.text("config.json"))
    cfg.update(cycles=3, period_ms=0, receipts=False)  # no agent here to send receipts
    flash.path("config.json").write_text(json.dumps(cfg))
    board = Board(flash).start()
    assert board.wait(60) == 0, board.console()[-3000:]
    assert board.done()["cycles"] == 3
    assert board.done()["sent"] >= 3


def test_a_board_whose_firmware_has_the_library_frozen_in_gets_no_copy_and_loses_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broker: Broker
) -> None:
    # MicroPython 1.21+ looks in the firmware before /lib: a library copied
    # there would never be imported, only take flash
    why = frozen.missing()
    if why:
        pytest.skip(why)
    firmware = frozen.frozen_firmware()
    flash = Flash(tmp_path / "board")
    flash.install_example("env_sensor", device_id="old-1", broker="127.0.0.1", wdt_ms=30000)
    old_lib = flash.root / "lib" / "iggy_device"
    old_lib.mkdir(parents=True)
    (old_lib / "node.mpy").write_bytes(b"an old library's bytecode")
    staging = tmp_path / "staging"
    staged = stage_env_sensor(staging, monkeypatch, "env-frozen", broker.port, mpy=True)
    assert any(p.startswith("lib/iggy_device/") for p in staged.files)  # what a plain board gets
    fake = FlashBoard(flash, firmware)
    monkeypatch.setattr(provision_plan, "run_mpremote", fake)
    said: list[str] = []
    copy_to_board("mpremote", "/dev/ttyUSB0", staged, staging, echo=lambda m, nl=True: said.append(m))
    assert any("iggy_device 0.1.0 is frozen into the firmware: not copied" in m for m in said), said
    copied_to = [c[-1] for c in fake.calls if c[:2] == ("fs", "cp")]
    assert copied_to  # the example and its config
    assert ":lib/iggy_device/" not in copied_to
    assert ("mip", "install", "umqtt.simple") not in fake.calls  # frozen in too
    assert not list(old_lib.glob("*.*py"))  # the old copy went
    (verified,) = [c for c in fake.calls if c[:2] == ("fs", "sha256sum")]
    assert not [p for p in verified[2:] if p.startswith(":lib/")]
    cfg = json.loads(flash.text("config.json"))
    cfg.update(cycles=3, period_ms=0, receipts=False)
    flash.path("config.json").write_text(json.dumps(cfg))
    board = Board(flash, firmware=firmware).start()
    assert board.wait(60) == 0, board.console()[-3000:]
    assert board.done()["sent"] >= 3


def test_provisioning_stops_before_touching_the_board_when_the_mpy_version_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_micropython()
    flash = Flash(tmp_path / "board")
    flash.root.mkdir(parents=True)
    staging = tmp_path / "staging"
    staging.mkdir()
    staged = prepare(
        source_root(),
        "env_sensor",
        staging,
        device_id="env-new",
        wifi_ssid="lab",
        wifi_password="x",
        broker="127.0.0.1",
        broker_port=1883,
        mpy=True,
    )
    # bytecode from an mpy-cross of another major .mpy version
    for p in staged.files.values():
        if p.suffix == ".mpy":
            data = bytearray(p.read_bytes())
            data[1] = 5
            p.write_bytes(bytes(data))
    fake = FlashBoard(flash)
    monkeypatch.setattr(provision_plan, "run_mpremote", fake)
    with pytest.raises(ProvisionError, match=r"loads \.mpy version 6, but mpy-cross here makes version 5"):
        copy_to_board("mpremote", "/dev/ttyUSB0", staged, staging)
    assert len(fake.calls) == 1  # the probe only


# -- issue 19: 6. C5/P4 offsets, 7. the application partition is checked too ----------
ESP32C5_CHIP_ID = 23


@pytest.mark.unit
def test_image_offsets_are_the_installed_esptools_bootloader_offsets(tmp_path: Path) -> None:
    """ESP32-C5 and -P4 boot from 0x2000 (MicroPython's download pages, and
    esptool's own table): an image written at 0x0 does not boot."""
    img = tmp_path / "fw.bin"
    for chip, cls in targets.CHIP_DEFS.items():
        if chip == "esp8266":
            continue  # not a board this project flashes
        assert Image(img, chip, chip.upper()).offset == cls.BOOTLOADER_FLASH_OFFSET, chip
    c5 = Image(img, "esp32c5", "ESP32-C5")
    assert esptool_argv("esptool", "/dev/ttyACM0", c5)[2][-2] == "0x2000"
    p4 = Image(img, "esp32p4", "ESP32-P4")
    assert esptool_argv("esptool", "/dev/ttyACM0", p4)[2][-2] == "0x2000"


def download_image(chip_id: int, offset: int, app: bytes | None = None, app_at: int = 0x10000) -> bytes:
    """A firmware download as micropython.org ships it: the flash from the
    image offset on, with the bootloader, the partition table at 0x8000 and
    the application (factory partition) at ``app_at``."""
    boot = esp_image(chip_id, b"ESP-IDF bootloader")
    app = esp_image(chip_id) if app is None else app
    table = b""
    for ptype, sub, at, size, label in ((1, 2, 0x9000, 0x6000, b"nvs"), (0, 0, app_at, 0x1F0000, b"factory")):
        table += b"\xaa\x50" + struct.pack("<BBII", ptype, sub, at, size) + label.ljust(16, b"\0") + b"\0" * 4
    out = bytearray(b"\xff" * (app_at - offset))
    out[: len(boot)] = boot
    t = 0x8000 - offset
    out[t : t + len(table)] = table
    return bytes(out) + app


def test_a_damaged_application_partition_is_refused_not_only_the_bootloader(tmp_path: Path) -> None:
    esptool = _esptool()
    good = tmp_path / "ESP32_GENERIC-20241129-v1.24.1.bin"
    good.write_bytes(download_image(ESP32_CHIP_ID, 0x1000))
    assert check_image(esptool, good).offset == 0x1000
    c5 = tmp_path / "ESP32_GENERIC_C5.bin"
    c5.write_bytes(download_image(ESP32C5_CHIP_ID, 0x2000))
    assert check_image(esptool, c5).chip == "esp32c5"

    data = bytearray(good.read_bytes())
    data[0x10000 - 0x1000 + 60] ^= 0xFF  # a flipped byte inside the application
    damaged = tmp_path / "damaged.bin"
    damaged.write_bytes(bytes(data))
    with pytest.raises(FlashError, match=r"partition 'factory'.*invalid.*download it again"):
        check_image(esptool, damaged)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(good.read_bytes()[: 0x10000 - 0x1000 + 8])  # the download stopped early
    with pytest.raises(FlashError, match="cut off"):
        check_image(esptool, cut)
    no_table = tmp_path / "no-table.bin"
    no_table.write_bytes(esp_image(ESP32_CHIP_ID) + b"\xff" * 0x9000)
    with pytest.raises(FlashError, match="no partition table"):
        check_image(esptool, no_table)
    other = tmp_path / "other-app.bin"
    other.write_bytes(download_image(ESP32_CHIP_ID, 0x1000, esp_image(ESP32_CHIP_ID, b"some other firmware")))
    with pytest.raises(FlashError, match="not MicroPython"):
        check_image(esptool, other)
