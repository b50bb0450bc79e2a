"""Issue 22's CLI structure: the CLI parses and prints; the libraries it
calls live beside what they work on."""

from __future__ import annotations

import inspect

import pytest
from iggy_edge.cli import doctor

pytestmark = pytest.mark.unit


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
