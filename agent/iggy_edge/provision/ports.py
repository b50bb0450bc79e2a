"""Serial ports: fail fast on a missing or busy one, and list them with the
USB-serial bridges ESP32 boards use marked."""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import NoBoardError, ProvisionError, busy
from .plan import run_mpremote
from .sources import tool

# USB-serial bridges found on ESP32 boards, so `list` can point at them
KNOWN_BRIDGES = {
    "10c4": "Silicon Labs CP210x",
    "1a86": "WCH CH340/CH9102",
    "303a": "Espressif native USB",
    "0403": "FTDI",
}


def check_port(port: str) -> None:
    """Fail fast, before any long step, on a missing or busy port."""
    if not Path(port).exists():
        raise NoBoardError(f"no board on {port}: the port does not exist (see `iggy-edge device ports`)")
    try:
        fd = os.open(port, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except PermissionError:
        raise ProvisionError(f"no permission to open {port}: add yourself to the 'dialout' group") from None
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise busy(port) from None
        raise NoBoardError(f"cannot open {port}: {e.strerror}") from None
    try:
        # pyserial (and so mpremote, a serial monitor, ...) take this lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise busy(port) from None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Port:
    device: str
    serial: str
    vid_pid: str
    manufacturer: str
    product: str

    @property
    def bridge(self) -> str:
        return KNOWN_BRIDGES.get(self.vid_pid.split(":")[0], "")


def parse_port_list(output: str) -> list[Port]:
    """`mpremote connect list`: `device serial vid:pid manufacturer product`
    (manufacturer may contain spaces; product is the last field)."""
    ports = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        ports.append(Port(parts[0], parts[1], parts[2], " ".join(parts[3:-1]), parts[-1]))
    return ports


def serial_ports() -> list[Port]:
    """The host's serial ports, as `mpremote connect list` sees them."""
    return parse_port_list(run_mpremote([tool("mpremote"), "connect", "list"], "list", timeout=30))
