"""What every doctor check returns, and the few things the checks share.

Each check lives beside what it checks (config_check.py, store/check.py,
broker_checks.py, broker_listener.py, uplink/iggy/check.py, httpd_check.py);
`iggy-edge doctor` (cli/doctor.py) runs them in its order and prints them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from .config import Settings

Status = Literal["ok", "warn", "fail", "skip"]
LOCAL_HOSTS: Final = {"127.0.0.1", "::1", "localhost"}
# The service's secrets (systemd's EnvironmentFile=), named in the fixes.
DEFAULT_ENV_FILE: Final = Path("/etc/iggy-edge/env")
TIMEOUT_S: Final = 5.0
# Said wherever doctor reads (or looks for) the broker's config file.
MOSQUITTO_CONF_HINT: Final = "name another with --mosquitto-conf PATH"
_RANK: Final[dict[Status, int]] = {"ok": 0, "skip": 0, "warn": 1, "fail": 2}


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def worse(a: Status, b: Status) -> Status:
    """The graver of two statuses (fail > warn > ok, skip)."""
    return max(a, b, key=_RANK.__getitem__)


def tcp_problem(host: str, port: int, timeout: float) -> str | None:
    """None when something accepts a TCP connection, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:.0f}s"
    except OSError as e:
        return e.strerror or str(e)


def not_local_broker(name: str, settings: Settings, conf: Path) -> Check | None:
    """The skip of a check that reads the broker's files, when they are not
    this machine's to read (a remote broker, or no such config here)."""
    if settings.mqtt.host not in LOCAL_HOSTS:
        return Check(name, "skip", f"broker on {settings.mqtt.host}: its config is not read here")
    if not conf.exists():
        return Check(name, "skip", f"no {conf} on this machine ({MOSQUITTO_CONF_HINT})")
    return None
