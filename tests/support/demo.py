"""What the demo tests share: the command, its arguments, reading its table."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

AGENT = str(Path(sys.executable).with_name("iggy-edge"))


def path_without_iggy_server() -> str:
    """PATH minus every directory that holds an iggy-server."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not (Path(d) / "iggy-server").exists())


def demo_env(path: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IGGY_")}
    env["PATH"] = path
    return env


def demo_rows(stdout: str) -> list[list[str]]:
    rows = [line.split() for line in stdout.splitlines() if line.strip().split(" ")[0].endswith("s")]
    return [r for r in rows if len(r) >= 8 and r[0][:-1].isdigit()]


DEMO_ARGS = ["demo", "--sensors", "3", "--rate", "5"]


def port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True
