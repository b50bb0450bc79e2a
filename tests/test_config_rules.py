"""The rules the sections share, each in one place: the gateway id (beside
the device id in device_ids.py, with its own reason), Iggy names, host:port
addresses and {device} templates, each checked whole (a trailing newline is
not part of a name)."""

from __future__ import annotations

from pathlib import Path

import pytest
from iggy_edge.config import ConfigError, parse_config
from iggy_edge.device_ids import device_id_problem, gateway_id_problem

pytestmark = pytest.mark.unit


def problems(tmp_path: Path, **raw: object) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        parse_config({"gateway_id": "gw", "state_dir": str(tmp_path), **raw}, source="t", env={})
    return dict(e.value.problems)


@pytest.mark.parametrize("bad", ["gw\n", "a.b", "", "-gw", "x" * 65, "gé"])
def test_the_gateway_rule_is_checked_whole(tmp_path: Path, bad: str):
    # "gw\n" passed before: re.match with "$" stops before a trailing newline
    assert gateway_id_problem(bad) is not None
    assert list(problems(tmp_path, gateway_id=bad)) == ["gateway_id"]


def test_a_device_id_is_never_checked_with_the_gateway_rule():
    # "sensor.1" is a device id (a topic level, an MQTT user) but no gateway
    # id (the gateway id ends the Iggy topic names after a '.')
    assert device_id_problem("sensor.1") is None
    assert gateway_id_problem("sensor.1") is not None
    assert gateway_id_problem("gw-01_a") is None


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"routes": [{"filter": "x/#", "stream": "edge\n"}]}, "routes[0].stream"),
        ({"downlink": {"commands_topic": "commands\n"}}, "downlink.commands_topic"),
        ({"iggy": {"kind": "iggy", "address": "h:8090\n"}}, "iggy"),
    ],
)
def test_names_and_addresses_with_a_trailing_newline_are_refused(
    tmp_path: Path, raw: dict[str, object], key: str
):
    assert key in problems(tmp_path, **raw)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("downlink", "command_topic", "edge/x{device}/down/cmd"),
        ("downlink", "config_mqtt_topic", "edge/{device}x/config"),
        ("receipts", "topic", "edge/{device}x/down/receipt"),
    ],
)
def test_device_templates_have_one_rule(tmp_path: Path, section: str, key: str, value: str):
    # command_topic and config_mqtt_topic took a device glued to other text
    # before (their own copy of the rule lacked the whole-level check)
    assert f"{section}.{key}" in problems(tmp_path, **{section: {key: value}})
