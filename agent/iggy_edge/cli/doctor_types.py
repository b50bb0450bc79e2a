"""What every doctor check returns (shared by doctor.py and doctor_trust.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from ..config import Settings

Status = Literal["ok", "warn", "fail", "skip"]
LOCAL_HOSTS: Final = {"127.0.0.1", "::1", "localhost"}


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


# Said wherever doctor reads (or looks for) the broker's config file.
MOSQUITTO_CONF_HINT: Final = "name another with --mosquitto-conf PATH"


def summary(checks: list[Check]) -> str:
    """The last line of doctor's text output: failures, warnings and whether
    the agent runs, never "all checks passed" when any of it is not so."""
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    agent = next((c for c in checks if c.name == "agent"), None)
    warnings = f"{warned} warning{'s' if warned != 1 else ''}"
    if failed:
        line = f"{failed} problem{'s' if failed != 1 else ''}" + (f", {warnings}" if warned else "")
    elif warned:
        line = f"passed with {warnings}"
    else:
        line = "all checks passed"
    if agent is not None and agent.status == "skip" and agent.detail.startswith("not running"):
        line += "; the agent is not running"
    return line


def not_local_broker(name: str, settings: Settings, conf: Path) -> Check | None:
    """The skip of a check that reads the broker's files, when they are not
    this machine's to read (a remote broker, or no such config here)."""
    if settings.mqtt.host not in LOCAL_HOSTS:
        return Check(name, "skip", f"broker on {settings.mqtt.host}: its config is not read here")
    if not conf.exists():
        return Check(name, "skip", f"no {conf} on this machine ({MOSQUITTO_CONF_HINT})")
    return None
