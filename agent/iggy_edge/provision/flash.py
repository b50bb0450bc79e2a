"""Put MicroPython on a blank (or any) ESP32 (`iggy-edge device flash`).

The firmware image is the user's file: the project cannot download it.
Get the board's image from https://micropython.org/download/ (for a plain
ESP32 module, ESP32_GENERIC: `ESP32_GENERIC-<date>-v<version>.bin`; the
ESP32-S3 and C3 boards have their own pages).  Everything goes through the
real `esptool` CLI (the `device` extra installs it), one subprocess per
step so a failure names the step:

1. `esptool image-info IMAGE` (no board needed): an ESP image whose
   checksum and hash are valid, for a chip esptool names, and MicroPython
   inside (its banner string).  esptool reads only the first image in the
   file, the bootloader; so the partition table at 0x8000 is read too and
   the application partition it names is checked the same way (a damaged
   or cut-off download fails here, not on the board).
2. `esptool --port PORT read-mac`: which chip answers on the port; it must
   be the image's chip.
3. `esptool --chip CHIP --port PORT erase-flash`, then `write-flash` at the
   chip's offset (0x1000 on ESP32 and ESP32-S2, 0x2000 on C5/P4/H4, 0x0 on
   the others),
   then esptool's hard reset.
4. mpremote until the board answers as MicroPython (the first boot makes
   the filesystem), so `device provision` can follow directly.
"""

from __future__ import annotations

import re
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .board import Probe, parse_probe

DOWNLOAD_HINT = (
    "get the image for your board from https://micropython.org/download/ (ESP32_GENERIC for a plain ESP32)"
)
ESPTOOL_TIMEOUT_S = 300.0  # an erase of a 16 MB flash takes about two minutes
BAUD = 460800
# where the image starts in flash: the ROM loads the 2nd stage bootloader
# from 0x1000 on ESP32 and ESP32-S2, 0x2000 on ESP32-C5, -P4, -H4 and -S31, 0x0 on
# the others (esptool's BOOTLOADER_FLASH_OFFSET; MicroPython's download
# pages say the same; a test compares this with the installed esptool)
OFFSETS = {
    "esp32": 0x1000,
    "esp32s2": 0x1000,
    "esp32c5": 0x2000,
    "esp32p4": 0x2000,
    "esp32h4": 0x2000,
    "esp32s31": 0x2000,
}
DEFAULT_OFFSET = 0x0
# A download .bin is the flash from the image offset on: the bootloader, the
# partition table at 0x8000 and the application at its partition's offset.
PARTITION_TABLE_AT = 0x8000
_PART_MAGIC = b"\xaa\x50"
_PART_APP = 0x00
MICROPYTHON_MARK = b"MicroPython v"


class FlashError(Exception):
    """A failure with a message meant for the person at the keyboard."""


@dataclass(frozen=True)
class Image:
    path: Path
    chip: str  # esptool's --chip name: esp32, esp32s3, ...
    label: str  # as esptool prints it: ESP32, ESP32-S3, ...

    @property
    def offset(self) -> int:
        return OFFSETS.get(self.chip, DEFAULT_OFFSET)


def chip_name(label: str) -> str:
    """esptool's label (ESP32-S3) as its --chip value (esp32s3)."""
    return label.lower().replace("-", "")


def parse_image_info(output: str) -> str:
    """The chip label from `esptool image-info`; FlashError when the image
    is not valid."""
    m = re.search(r"Detected image type:\s*(\S+)", output)
    if m is None:
        raise FlashError("esptool did not recognise the image: " + _last_line(output))
    if "(invalid)" in output:
        bad = [line.strip() for line in output.splitlines() if "(invalid)" in line]
        raise FlashError("the image is damaged (" + "; ".join(bad) + "): download it again")
    return m.group(1)


def parse_chip(output: str) -> str | None:
    """The chip label from esptool's connect banner (`Connected to ESP32 on
    /dev/ttyUSB0:` in esptool 5, `Chip is ESP32-D0WD-V3 ...` in 4)."""
    m = re.search(r"Connected to (ESP\S+) on", output)
    if m is not None:
        return m.group(1)
    m = re.search(r"Detecting chip type\.*\s*(ESP\S+)", output)
    if m is not None:
        return m.group(1)
    return None


def _last_line(output: str) -> str:
    lines = [x for x in output.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else "(no output)"


def classify(port: str, output: str) -> FlashError:
    """esptool's failures as something a person can act on."""
    text = output
    if "could not open port" in text.lower() or "no such file or directory" in text.lower():
        return FlashError(f"no board on {port}: the port does not exist (see `iggy-edge device ports`)")
    if "Resource busy" in text or "port is busy" in text.lower() or "Errno 16" in text:
        return FlashError(f"{port} is busy: close the program holding it (a serial monitor, mpremote)")
    if "Failed to connect" in text or "No serial data received" in text:
        return FlashError(
            f"no ESP chip answers on {port}: hold the board's BOOT button, press RESET, release BOOT, "
            "and retry (some boards need this to enter the ROM bootloader)"
        )
    m = re.search(r"This chip is ([\w-]+),? not ([\w-]+)", text)
    if m is not None:
        return FlashError(f"the board is an {m.group(1)} but the image is for {m.group(2)}: {DOWNLOAD_HINT}")
    return FlashError("esptool failed: " + _last_line(text))


def esptool_argv(esptool: str, port: str, image: Image, *, baud: int = BAUD) -> list[list[str]]:
    """The esptool command lines `device flash` runs against the board, in
    order: identify, erase, write (esptool resets the board afterwards)."""
    base = [esptool, "--chip", image.chip, "--port", port]
    return [
        [esptool, "--port", port, "read-mac"],
        [*base, "erase-flash"],
        [*base, "--baud", str(baud), "write-flash", f"0x{image.offset:x}", str(image.path)],
    ]


Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]


def run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise FlashError(f"{Path(argv[0]).name} did not finish within {timeout:.0f}s") from None


def check_image(esptool: str, path: Path, runner: Runner = run) -> Image:
    """The image file as esptool reads it; FlashError unless it is a valid
    ESP image with MicroPython in it."""
    if not path.is_file():
        raise FlashError(f"no firmware image at {path}: {DOWNLOAD_HINT}")
    r = runner([esptool, "image-info", str(path)], 60.0)
    output = r.stdout + r.stderr
    if r.returncode != 0:
        raise FlashError(f"{path} is not an ESP firmware image ({_last_line(output)}): {DOWNLOAD_HINT}")
    label = parse_image_info(output)
    image = Image(path, chip_name(label), label)
    data = path.read_bytes()
    app = _check_application(esptool, image, data, runner)
    if MICROPYTHON_MARK not in app:
        raise FlashError(f"{path} is an {label} image but not MicroPython: {DOWNLOAD_HINT}")
    return image


def app_partitions(data: bytes, image_offset: int) -> list[tuple[str, int, int]]:
    """(label, flash offset, size) of the application partitions in the
    partition table inside a download image that starts at ``image_offset``
    in flash; [] when the file has no table there."""
    start = PARTITION_TABLE_AT - image_offset
    out = []
    for i in range(start, min(start + 0xC00, len(data)), 32):
        entry = data[i : i + 32]
        if len(entry) < 32 or entry[:2] != _PART_MAGIC:
            break
        ptype, _subtype, offset, size = struct.unpack_from("<BBII", entry, 2)
        if ptype == _PART_APP:
            out.append((entry[12:28].rstrip(b"\0").decode(errors="replace"), offset, size))
    return out


def _check_application(esptool: str, image: Image, data: bytes, runner: Runner) -> bytes:
    """The application part of a download image, checked by esptool as the
    bootloader was; the whole file when it holds only one image (shorter
    than the partition table offset)."""
    if len(data) <= PARTITION_TABLE_AT - image.offset:
        return data
    apps = app_partitions(data, image.offset)
    if not apps:
        raise FlashError(
            f"{image.path} has no partition table at 0x{PARTITION_TABLE_AT:x}: "
            f"not a complete firmware download: {DOWNLOAD_HINT}"
        )
    label, offset, _size = apps[0]  # factory (or ota_0): what the bootloader starts
    start = offset - image.offset
    if start < 0 or start + 24 > len(data):
        raise FlashError(
            f"{image.path} ends before its application partition {label!r} at 0x{offset:x}: "
            f"the download is cut off: {DOWNLOAD_HINT}"
        )
    with tempfile.TemporaryDirectory(prefix="iggy-edge-image-") as tmp:
        part = Path(tmp) / "application.bin"
        part.write_bytes(data[start:])
        r = runner([esptool, "image-info", str(part)], 60.0)
    output = r.stdout + r.stderr
    if r.returncode != 0:
        raise FlashError(
            f"the application partition {label!r} of {image.path.name} is not a valid image "
            f"({_last_line(output)}): download it again"
        )
    try:
        app_label = parse_image_info(output)
    except FlashError as e:
        raise FlashError(f"application partition {label!r}: {e}") from None
    if chip_name(app_label) != image.chip:
        raise FlashError(
            f"{image.path.name}: the bootloader is for {image.label}, the application for {app_label}"
        )
    return data[start:]


def flash(
    esptool: str,
    port: str,
    image: Image,
    *,
    echo: Callable[[str], None],
    runner: Runner = run,
    baud: int = BAUD,
) -> str:
    """Identify, erase and write; returns the chip label the board gave."""
    identify, erase, write = esptool_argv(esptool, port, image, baud=baud)
    echo(f"identify the chip on {port} ...")
    r = runner(identify, 60.0)
    output = r.stdout + r.stderr
    if r.returncode != 0:
        raise classify(port, output)
    chip = parse_chip(output)
    if chip is None:
        raise FlashError(f"esptool did not say which chip is on {port}: {_last_line(output)}")
    if chip_name(chip) != image.chip:
        raise FlashError(
            f"the board on {port} is an {chip} but {image.path.name} is for {image.label}: {DOWNLOAD_HINT}"
        )
    for label, argv in (
        ("erase the flash", erase),
        (f"write {image.path.name} at 0x{image.offset:x}", write),
    ):
        echo(f"{label} ...")
        t0 = time.monotonic()
        r = runner(argv, ESPTOOL_TIMEOUT_S)
        if r.returncode != 0:
            raise classify(port, r.stdout + r.stderr)
        echo(f"  done ({time.monotonic() - t0:.1f}s)")
    return chip


def wait_for_micropython(
    probe: Callable[[], str | None], timeout: float = 45.0, interval: float = 1.0
) -> Probe:
    """Until the board answers PROBE as MicroPython (after the reset the
    first boot formats the filesystem; a native-USB board re-enumerates)."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        output = probe()
        if output is not None:
            found = parse_probe(output)
            if found is not None and found.impl == "micropython":
                return found
            last = _last_line(output)
        if time.monotonic() > deadline:
            raise FlashError(
                f"the board did not answer as MicroPython within {timeout:.0f}s after flashing: {last}"
            )
        time.sleep(interval)
