"""`iggy-edge device flash`: put MicroPython on a blank (or any) ESP32.

The image checks, the offsets per chip and the esptool command lines are
provision/flash.py's; this is the command (registered in cli/device.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..provision import ProvisionError, flash, ports, sources
from ..provision.plan import probe_board
from .common import fail


def flash_cmd(
    port: Annotated[str, typer.Option(help="Serial port of the board, e.g. /dev/ttyUSB0.")],
    firmware: Annotated[
        Path,
        typer.Option(
            help="MicroPython image for the board, e.g. ESP32_GENERIC-<date>-v1.24.1.bin "
            "(from https://micropython.org/download/)."
        ),
    ],
    baud: Annotated[int, typer.Option(help="Baud rate for writing.")] = flash.BAUD,
) -> None:
    """Erase the board and write MicroPython with esptool; then `device provision` works."""
    try:
        esptool = sources.tool("esptool")
        image = flash.check_image(esptool, firmware)
        typer.echo(f"{firmware.name}: MicroPython image for {image.label} (written at 0x{image.offset:x})")
        ports.check_port(port)
        chip = flash.flash(esptool, port, image, echo=typer.echo, baud=baud)
        typer.echo("wait for MicroPython to boot (the first boot makes the filesystem) ...")
        probe = flash.wait_for_micropython(lambda: probe_board(sources.tool("mpremote"), port))
    except (ProvisionError, flash.FlashError) as e:
        raise fail(str(e)) from None
    fw = ".".join(str(x) for x in probe.version)
    frozen = (
        "umqtt.simple built in"
        if probe.umqtt
        else "umqtt.simple not built in: provisioning installs it (mip)"
    )
    typer.echo(
        f"{chip} on {port} runs MicroPython {fw} ({frozen}); "
        f"next: iggy-edge device provision --port {port} ..."
    )
