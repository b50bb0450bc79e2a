"""Routing: MQTT topic -> Iggy route, or a dead-letter reason.  Pure, no I/O.

Rules are tried in configuration order; the first whose MQTT filter matches
wins.  The partition key is one topic level (normally the device id), so all
of a device's records land in one partition, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from .config import RouteSettings
from .records import Route

# The MQTT topic travels as an Iggy header value, which Iggy caps at 255 bytes.
MAX_TOPIC_BYTES: Final = 255
CACHE_LIMIT: Final = 4096


class DeadLetterReason(StrEnum):
    """The fixed set of reasons a message is dead-lettered (metric labels)."""

    OVERSIZE = "oversize"
    UNROUTABLE = "unroutable"
    INVALID_TOPIC = "invalid_topic"
    EMPTY_PAYLOAD = "empty_payload"
    TOO_MANY_TOPICS = "too_many_topics"  # the device's distinct topics (store/devices.py)
    TOO_MANY_DEVICES = "too_many_devices"  # devices tracked by the buffer (store/devices.py)


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: DeadLetterReason
    detail: str


def topic_matches(filter_levels: Sequence[str], topic_levels: Sequence[str]) -> bool:
    """MQTT topic-filter matching (`+` one level, `#` the rest), including the
    rule that wildcards at the first level do not match topics starting with '$'."""
    if topic_levels and topic_levels[0].startswith("$") and filter_levels[0] in ("+", "#"):
        return False
    for i, f in enumerate(filter_levels):
        if f == "#":
            return True
        if i >= len(topic_levels):
            return False
        if f != "+" and f != topic_levels[i]:
            return False
    return len(filter_levels) == len(topic_levels)


def check_topic(topic: str | bytes) -> str | Rejected:
    """A usable topic name, or why not (gmqtt hands over bytes when the topic
    is not UTF-8)."""
    if isinstance(topic, bytes):
        return Rejected(DeadLetterReason.INVALID_TOPIC, "topic is not valid UTF-8")
    if not topic:
        return Rejected(DeadLetterReason.INVALID_TOPIC, "empty topic")
    if "\x00" in topic or "+" in topic or "#" in topic:
        return Rejected(DeadLetterReason.INVALID_TOPIC, "topic contains NUL or a wildcard")
    if len(topic.encode()) > MAX_TOPIC_BYTES:
        return Rejected(DeadLetterReason.INVALID_TOPIC, f"topic longer than {MAX_TOPIC_BYTES} bytes")
    return topic


class Router:
    """Compiled routing rules with a bounded cache of topic -> route."""

    def __init__(self, rules: Sequence[RouteSettings], max_payload_bytes: int) -> None:
        self._rules = [(r.filter.split("/"), r) for r in rules]
        self.max_payload = max_payload_bytes
        self._cache: dict[str, Route | Rejected] = {}
        # The topics of `_cache` that route (a subset of it): ingest looks a
        # message's topic up here first (one call less a message) and calls
        # `route` for a miss or a payload outside 1..max_payload.  (Keyed by
        # str | bytes only so a bytes topic may be looked up: it misses.)
        self.routes: dict[str | bytes, Route] = {}

    def route(self, topic: str | bytes, payload_size: int) -> Route | Rejected:
        if payload_size == 0:
            # Iggy refuses empty messages; MQTT uses them to clear retained topics.
            return Rejected(DeadLetterReason.EMPTY_PAYLOAD, "empty payload (Iggy cannot store it)")
        if payload_size > self.max_payload:
            return Rejected(
                DeadLetterReason.OVERSIZE,
                f"payload {payload_size} bytes > max_payload_bytes {self.max_payload}",
            )
        if isinstance(topic, str):
            hit = self._cache.get(topic)
            if hit is not None:
                return hit
        checked = check_topic(topic)
        if isinstance(checked, Rejected):
            return checked
        result = self._match(checked)
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()  # cheap bound; device topics are a small, stable set
            self.routes.clear()
        self._cache[checked] = result
        if isinstance(result, Route):
            self.routes[checked] = result
        return result

    def _match(self, topic: str) -> Route | Rejected:
        levels = topic.split("/")
        for filter_levels, rule in self._rules:
            if not topic_matches(filter_levels, levels):
                continue
            if rule.key_level is None:
                key = topic
            elif rule.key_level < len(levels) and levels[rule.key_level]:
                key = levels[rule.key_level]
            else:
                return Rejected(
                    DeadLetterReason.UNROUTABLE,
                    f"rule {rule.filter!r} takes the key from level {rule.key_level}, "
                    "which this topic does not have",
                )
            return Route(rule.stream, rule.topic, key)
        return Rejected(DeadLetterReason.UNROUTABLE, "no route matches this topic")
