"""The one home of the device topic layout (agent/iggy_edge/topics.py)."""

from __future__ import annotations

import pytest
from iggy_edge.device_ids import MAX_CHARS
from iggy_edge.routing import MAX_TOPIC_BYTES
from iggy_edge.topics import DEFAULT, MAX_PREFIX_BYTES, TopicLayout, prefix_problem

pytestmark = pytest.mark.unit


def test_default_layout_is_the_device_librarys():
    # device/iggy_device/codec.py: {prefix}/{device}/up/{channel}, .../status, .../down/cmd|config|receipt
    assert DEFAULT.up("d1", "env") == "edge/d1/up/env"
    assert DEFAULT.status("d1") == "edge/d1/status"
    assert DEFAULT.command("d1") == "edge/d1/down/cmd"
    assert DEFAULT.config("d1") == "edge/d1/down/config"
    assert DEFAULT.receipt("d1") == "edge/d1/down/receipt"
    assert (DEFAULT.up_filter, DEFAULT.ack_filter, DEFAULT.status_filter) == (
        "edge/+/up/#",
        "edge/+/up/ack",
        "edge/+/status",
    )
    assert DEFAULT.receipt_template == "edge/{device}/down/receipt"


@pytest.mark.parametrize(
    ("topic", "device"),
    [
        ("edge/d1/up/env", "d1"),
        ("edge/d1/up/a/b", "d1"),
        ("edge/d1/up", None),
        ("edge//up/env", None),
        ("edge/d1/status", None),
        ("edgy/d1/up/env", None),
        ("other/edge/d1/up/env", None),
    ],
)
def test_device_of_up(topic: str, device: str | None):
    assert DEFAULT.device_of_up(topic) == device


@pytest.mark.parametrize(
    ("topic", "device"),
    [
        ("edge/d1/status", "d1"),
        ("edge/a/b/status", None),
        ("edge//status", None),
        ("edge/d1/up/status", None),
    ],
)
def test_device_of_status(topic: str, device: str | None):
    assert DEFAULT.device_of_status(topic) == device


def test_device_of_ack_only_the_ack_topic():
    assert DEFAULT.device_of_ack("edge/d1/up/ack") == "d1"
    assert DEFAULT.device_of_ack("edge/d1/up/ack/x") is None
    assert DEFAULT.device_of_ack("edge/d1/up/env") is None


def test_a_custom_prefix_moves_every_name():
    layout = TopicLayout("site-7/edge")
    assert layout.command("d") == "site-7/edge/d/down/cmd"
    assert layout.device_of_up("site-7/edge/d/up/env") == "d"
    assert layout.device_of_up("edge/d/up/env") is None
    assert layout.acl_patterns() == (
        "pattern write site-7/edge/%u/up/#",
        "pattern write site-7/edge/%u/status",
        "pattern read site-7/edge/%u/down/#",
    )


def test_templates_outside_the_down_tree_are_recognised():
    assert DEFAULT.in_down_tree("edge/{device}/down/receipt")
    assert not DEFAULT.in_down_tree("edge/{device}/receipt")  # the ACL lets the device read only down/#
    assert not DEFAULT.in_down_tree("other/{device}/down/receipt")


@pytest.mark.parametrize(
    "bad", ["", "/edge", "edge/", "a//b", "a/+/b", "a#", "a\x00", "a\nb", "é", "x" * 129, 7]
)
def test_bad_prefixes_are_refused_with_a_reason(bad: object):
    assert prefix_problem(bad)
    if isinstance(bad, str):
        with pytest.raises(ValueError, match="topic prefix"):
            TopicLayout(bad)


def test_longest_reading_topic_fits_the_iggy_header_cap():
    layout = TopicLayout("p" * MAX_PREFIX_BYTES)
    assert len(layout.up("d" * MAX_CHARS, "c" * 32).encode()) <= MAX_TOPIC_BYTES


def test_settings_carry_the_layout_and_refuse_a_bad_prefix():
    from iggy_edge.config import ConfigError, parse_config  # noqa: PLC0415

    assert parse_config({"gateway_id": "gw"}, env={}).topics == DEFAULT
    assert (
        parse_config({"gateway_id": "gw", "topic_prefix": "site/edge"}, env={}).topics.prefix == "site/edge"
    )
    with pytest.raises(ConfigError, match="topic_prefix"):
        parse_config({"gateway_id": "gw", "topic_prefix": "a/+"}, env={})
