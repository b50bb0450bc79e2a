"""What every doctor check returns (shared by doctor.py and doctor_trust.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

Status = Literal["ok", "warn", "fail", "skip"]
LOCAL_HOSTS: Final = {"127.0.0.1", "::1", "localhost"}


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""
