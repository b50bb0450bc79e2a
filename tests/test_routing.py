"""Routing is pure: topic in, route or dead-letter reason out."""

from __future__ import annotations

import pytest
from iggy_edge import routing
from iggy_edge.config import RouteSettings
from iggy_edge.records import Route
from iggy_edge.routing import DeadLetterReason, Rejected, Router, check_topic, topic_matches

pytestmark = pytest.mark.unit


def rules(*specs: tuple[str, str, int | None]) -> list[RouteSettings]:
    return [RouteSettings(filter=f, stream="edge", topic=t, key_level=k) for f, t, k in specs]


DEFAULT = rules(("edge/+/up/ack", "acks", 1), ("edge/+/status", "events", 1), ("edge/+/up/#", "telemetry", 1))


@pytest.mark.parametrize(
    ("flt", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+", "a", False),
        ("a/+", "a/", True),  # an empty level is a level
        ("a/#", "a", True),  # '#' also matches the parent level
        ("a/#", "a/b/c/d", True),
        ("#", "x/y", True),
        ("+/+", "x/y", True),
        ("+", "/x", False),
        ("+/x", "/x", True),
        ("#", "$SYS/broker/uptime", False),  # wildcards at level 0 never match $-topics
        ("+/broker/uptime", "$SYS/broker/uptime", False),
        ("$SYS/#", "$SYS/broker/uptime", True),
        ("a/b/c", "a/b", False),
    ],
)
def test_topic_filter_matching(flt: str, topic: str, expected: bool) -> None:
    assert topic_matches(flt.split("/"), topic.split("/")) is expected


def test_first_matching_rule_wins_and_key_is_the_device_level() -> None:
    r = Router(DEFAULT, max_payload_bytes=100)
    assert r.route("edge/dev-1/up/ack", 5) == Route("edge", "acks", "dev-1")
    assert r.route("edge/dev-2/up/env", 5) == Route("edge", "telemetry", "dev-2")
    assert r.route("edge/dev-2/up/env/deep/er", 5) == Route("edge", "telemetry", "dev-2")
    assert r.route("edge/dev-3/status", 5) == Route("edge", "events", "dev-3")


def test_key_level_none_uses_whole_topic_and_other_levels() -> None:
    r = Router(rules(("site/+/+/#", "t", 2), ("raw/#", "raw", None)), max_payload_bytes=100)
    assert r.route("site/a/pump-7/x", 1) == Route("edge", "t", "pump-7")
    assert r.route("raw/a/b", 1) == Route("edge", "raw", "raw/a/b")


def test_key_level_beyond_topic_or_empty_is_unroutable() -> None:
    r = Router(rules(("x/#", "t", 3)), max_payload_bytes=100)
    got = r.route("x/a", 1)
    assert isinstance(got, Rejected)
    assert got.reason is DeadLetterReason.UNROUTABLE
    assert "level 3" in got.detail
    empty_key = Router(rules(("edge/+/up", "t", 1)), max_payload_bytes=100).route("edge//up", 1)
    assert isinstance(empty_key, Rejected)
    assert empty_key.reason is DeadLetterReason.UNROUTABLE


def test_unroutable_topic() -> None:
    got = Router(DEFAULT, max_payload_bytes=100).route("other/dev/up/x", 1)
    assert got == Rejected(DeadLetterReason.UNROUTABLE, "no route matches this topic")


def test_dollar_topic_not_routed_by_wildcard_rule() -> None:
    got = Router(rules(("#", "all", None)), max_payload_bytes=100).route("$SYS/broker/load", 1)
    assert isinstance(got, Rejected)
    assert got.reason is DeadLetterReason.UNROUTABLE


def test_oversize_payload_is_checked_first() -> None:
    r = Router(DEFAULT, max_payload_bytes=10)
    assert isinstance(r.route("edge/d/up/env", 10), Route)
    got = r.route("edge/d/up/env", 11)
    assert isinstance(got, Rejected)
    assert got.reason is DeadLetterReason.OVERSIZE
    assert "11" in got.detail
    # oversize wins even on a cached topic and on a bad topic
    bad = r.route(b"\xff\xfe", 11)
    assert isinstance(bad, Rejected)
    assert bad.reason is DeadLetterReason.OVERSIZE


@pytest.mark.parametrize(
    ("topic", "detail"),
    [
        (b"edge/\xff/up/x", "UTF-8"),
        ("", "empty"),
        ("edge/a\x00b/up/x", "NUL"),
        ("edge/+/up/x", "wildcard"),
        ("edge/#", "wildcard"),
        ("edge/" + "x" * 1100 + "/up/x", "longer"),
    ],
)
def test_invalid_topics(topic: str | bytes, detail: str) -> None:
    got = Router(DEFAULT, max_payload_bytes=100).route(topic, 1)
    assert isinstance(got, Rejected)
    assert got.reason is DeadLetterReason.INVALID_TOPIC
    assert detail in got.detail
    assert check_topic(topic) == got


def test_multibyte_topic_length_counts_bytes() -> None:
    limit = routing.MAX_TOPIC_BYTES
    ok = "é" * (limit // 2)
    assert check_topic(ok) == ok
    assert isinstance(check_topic("é" * (limit // 2 + 1)), Rejected)


def test_route_cache_is_bounded_and_results_stay_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "CACHE_LIMIT", 50)
    r = Router(DEFAULT, max_payload_bytes=100)
    for i in range(500):
        assert r.route(f"edge/dev-{i}/up/env", 1) == Route("edge", "telemetry", f"dev-{i}")
        assert len(r._cache) <= 50
    # unroutable results are cached too (and still correct)
    assert isinstance(r.route("nope", 1), Rejected)
    assert isinstance(r.route("nope", 1), Rejected)
