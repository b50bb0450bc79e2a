"""The device topics in the settings follow `topic_prefix` (topics.py), and
a value that disagrees with the layout the boards and the broker's ACL use
is refused with its key and the fix."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from iggy_edge.config import ConfigError, ReceiptSettings, Settings, load_config, parse_config
from iggy_edge.reload import plan
from iggy_edge.topics import TopicLayout
from pydantic import ValidationError

pytestmark = pytest.mark.unit

LAYOUT_KEYS = {
    ("downlink", "command_topic"): "other/{device}/down/cmd",
    ("downlink", "config_mqtt_topic"): "edge/{device}/config",
    ("downlink", "ack_filter"): "edge/+/ack",
    ("receipts", "topic"): "other/{device}/r",
}


def parse(tmp_path: Path, **raw: object) -> Settings:
    return parse_config({"gateway_id": "gw", "state_dir": str(tmp_path), **raw}, source="t", env={})


def problems(tmp_path: Path, **raw: object) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, **raw)
    return dict(e.value.problems)


@pytest.mark.parametrize(("section", "key"), list(LAYOUT_KEYS))
def test_a_device_topic_that_disagrees_with_the_layout_is_refused(tmp_path: Path, section: str, key: str):
    got = problems(tmp_path, **{section: {key: LAYOUT_KEYS[section, key]}})
    assert list(got) == [f"{section}.{key}"], got
    assert "set topic_prefix" in got[f"{section}.{key}"]


def test_a_receipt_topic_elsewhere_no_longer_silently_stops_receipts(tmp_path: Path):
    # loaded before: devices.py then looked for readings under other/, the
    # boards listened on edge/<id>/down/receipt and the ACL let them read only that
    message = problems(tmp_path, receipts={"topic": "other/{device}/r"})["receipts.topic"]
    assert "'edge/{device}/down/receipt'" in message


def test_a_value_with_another_prefix_names_that_prefix(tmp_path: Path):
    message = problems(tmp_path, receipts={"topic": "site/a/{device}/down/receipt"})["receipts.topic"]
    assert 'set topic_prefix = "site/a"' in message


def test_existing_configs_that_spell_the_defaults_still_load(tmp_path: Path):
    s = parse(
        tmp_path,
        downlink={
            "command_topic": "edge/{device}/down/cmd",
            "config_mqtt_topic": "edge/{device}/down/config",
            "ack_filter": "edge/+/up/ack",
        },
        receipts={"topic": "edge/{device}/down/receipt"},
    )
    assert s == parse(tmp_path)


def test_topic_prefix_moves_every_device_topic_and_the_default_subscriptions_and_routes(tmp_path: Path):
    s = parse(tmp_path, topic_prefix="site")
    assert s.downlink.command_topic == "site/{device}/down/cmd"
    assert s.downlink.config_mqtt_topic == "site/{device}/down/config"
    assert s.downlink.ack_filter == "site/+/up/ack"
    assert s.receipts.topic == "site/{device}/down/receipt"
    assert [x.filter for x in s.mqtt.subscriptions] == ["site/+/up/#", "site/+/status"]
    assert [(r.filter, r.stream, r.topic, r.key_level) for r in s.routes] == [
        ("site/+/up/ack", "edge", "acks", 1),
        ("site/+/status", "edge", "events", 1),
        ("site/+/up/#", "edge", "telemetry", 1),
    ]


def test_a_prefix_of_two_levels_keys_the_default_routes_by_the_device_level(tmp_path: Path):
    s = parse(tmp_path, topic_prefix="plant-7/edge")
    assert {r.key_level for r in s.routes} == {2}
    assert s.routes[2].filter == "plant-7/edge/+/up/#"


def test_spelling_the_moved_topics_and_setting_subscriptions_and_routes_is_the_users_choice(tmp_path: Path):
    s = parse(
        tmp_path,
        topic_prefix="site",
        receipts={"topic": "site/{device}/down/receipt", "mode": "iggy"},
        mqtt={"subscriptions": [{"filter": "#"}], "port": 1884},
        routes=[{"filter": "site/+/up/#"}],
        downlink={"enabled": False},
    )
    assert s.receipts.topic == "site/{device}/down/receipt"
    assert [x.filter for x in s.mqtt.subscriptions] == ["#"]
    assert [r.filter for r in s.routes] == ["site/+/up/#"]
    assert s.downlink.command_topic == "site/{device}/down/cmd"
    assert (s.mqtt.port, s.downlink.enabled) == (1884, False)


def test_a_bad_prefix_is_reported_once_and_alone(tmp_path: Path):
    assert list(problems(tmp_path, topic_prefix="a/+")) == ["topic_prefix"]


def test_settings_built_in_code_follow_the_prefix_and_refuse_a_stray_topic():
    s = Settings(gateway_id="gw", topic_prefix="site", receipts=ReceiptSettings(mode="iggy"))
    assert (s.receipts.topic, s.receipts.mode) == ("site/{device}/down/receipt", "iggy")
    with pytest.raises(ValidationError) as e:
        Settings(gateway_id="gw", receipts=ReceiptSettings(topic="x/{device}/down/receipt"))
    assert [err["loc"] for err in e.value.errors()] == [("receipts", "topic")]


def test_a_reload_that_moves_the_prefix_does_not_move_the_routes_alone(tmp_path: Path):
    # topic_prefix needs a restart (the subscriptions, the receipts, the
    # return path follow it); routes that followed it must wait for that too,
    # or every reading would be unroutable until the restart.
    running, new = parse(tmp_path), parse(tmp_path, topic_prefix="site")
    p = plan(running, new)
    assert not p.live, [str(c) for c in p.live]
    assert {"topic_prefix", "routes", "receipts.topic"} <= {c.key for c in p.restart}
    assert p.settings.routes == running.routes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True), min_size=1, max_size=4).map("/".join))
def test_every_valid_prefix_gives_settings_that_agree_with_its_layout(prefix: str):
    s = parse_config({"gateway_id": "gw", "topic_prefix": prefix}, env={})
    layout = TopicLayout(prefix)
    assert s.topics == layout
    assert (s.downlink.command_topic, s.downlink.config_mqtt_topic, s.receipts.topic) == (
        layout.command_template,
        layout.config_template,
        layout.receipt_template,
    )
    assert s.downlink.ack_filter == layout.ack_filter
    assert {x.filter for x in s.mqtt.subscriptions} == {layout.up_filter, layout.status_filter}
    topic = layout.up("d1", "env")
    assert [r.topic for r in s.routes if r.filter == layout.up_filter]
    assert {topic.split("/")[r.key_level or 0] for r in s.routes} == {"d1"}
    assert parse_config(s.model_dump(), env={}) == s  # what it prints loads back the same


def test_the_shipped_example_with_another_prefix_moves_every_device_topic(tmp_path: Path):
    example = Path(str(resources.files("iggy_edge") / "examples" / "config.toml")).read_text()
    assert '\ntopic_prefix = "edge"\n' in example
    cfg = tmp_path / "config.toml"
    cfg.write_text(example.replace('\ntopic_prefix = "edge"\n', '\ntopic_prefix = "site"\n'))
    s = load_config(cfg, env={})
    assert s.receipts.topic == "site/{device}/down/receipt"
    assert s.downlink.ack_filter == "site/+/up/ack"
    assert {x.filter for x in s.mqtt.subscriptions} == {"site/+/up/#", "site/+/status"}
    assert all(r.filter.startswith("site/") for r in s.routes)
