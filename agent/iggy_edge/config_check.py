"""Doctor's config check: the file parses and validates with the service's
secrets (the env file systemd passes, read as EnvironmentFile= reads it)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .checks import Check
from .config import ConfigError, Settings, load_config


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile= reads them (comments,
    blank lines, optional quotes)."""
    env: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def check_config(path: Path, env: Mapping[str, str]) -> tuple[Check, Settings | None]:
    try:
        settings = load_config(path, env=env)
    except ConfigError as e:
        lines = "; ".join(f"{k}: {m}" for k, m in e.problems)
        return Check(
            "config", "fail", f"{e.source}: {lines}", f"edit {path}, then: iggy-edge config check {path}"
        ), None
    where = settings.iggy.where if settings.iggy.kind == "iggy" else settings.iggy.kind
    return Check("config", "ok", f"{path}: gateway {settings.gateway_id}, uplink {where}"), settings
