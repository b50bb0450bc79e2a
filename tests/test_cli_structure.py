"""Issue 22's CLI structure: the CLI parses and prints; the libraries it
calls live beside what they work on."""

from __future__ import annotations

import inspect
from pathlib import Path

import iggy_edge.cli
import pytest
from iggy_edge.cli import doctor

pytestmark = pytest.mark.unit

CLI = Path(iggy_edge.cli.__file__).parent
MAX_CLI_LINES = 300


@pytest.mark.parametrize(
    "module",
    # cli/device*.py (provisioning) are held to the same bound by their own tests
    sorted(p.name for p in CLI.glob("*.py") if not p.name.startswith("device")),
)
def test_cli_module_is_thin(module: str) -> None:
    lines = len((CLI / module).read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_CLI_LINES, f"cli/{module} has {lines} lines: it holds a library"


def test_doctor_checks_live_beside_what_they_check() -> None:
    checks = {
        name: obj.__module__
        for name, obj in vars(doctor).items()
        if name.startswith("check_") and inspect.isfunction(obj)
    }
    assert checks == {
        "check_config": "iggy_edge.config_check",
        "check_clock": "iggy_edge.clock_check",
        "check_disk": "iggy_edge.store.check",
        "check_broker": "iggy_edge.broker_checks",
        "check_broker_config": "iggy_edge.broker_checks",
        "check_device_users": "iggy_edge.broker_checks",
        "check_agent_listener": "iggy_edge.broker_listener",
        "check_iggy": "iggy_edge.uplink.iggy.check",
        "check_iggy_transport": "iggy_edge.uplink.iggy.check",
        "check_agent": "iggy_edge.httpd_check",
    }
