"""What a reload (SIGHUP, ``systemctl reload iggy-edge``) can change without
a restart, and what it cannot.

`plan(running, new)` compares two validated configurations key by key
(dotted paths, ``routes`` as a whole) and returns a `Plan`: the changes a
reload takes (`LIVE`: bounds, TTLs, routes, log level, receipts and
downlink timing, batching and health thresholds), those that need a restart
(everything that names a connection, an identity, a file or a topic), and
the settings the agent runs on afterwards: the running ones with only the
live changes applied (a change of `topic_prefix` holds back the routes,
which follow it).  A reload of a file that does not validate changes
nothing.  `iggy-edge config check NEW --against RUNNING` prints the same
plan without touching the agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from pydantic import SecretStr

from .config import Settings

# Keys a running agent takes on reload.  A key not listed needs a restart.
LIVE: Final = frozenset(
    {
        "logging.level",
        "routes",
        "buffer.max_records",
        "buffer.max_bytes",
        "buffer.overflow",
        "buffer.ttl_s",
        "buffer.max_payload_bytes",
        "buffer.max_dead_letters",
        "buffer.max_dead_letter_bytes",
        "buffer.max_topics_per_device",
        "buffer.max_devices",
        "forward.batch_records",
        "forward.batch_bytes",
        "forward.linger_ms",
        "forward.backoff_initial_s",
        "forward.backoff_max_s",
        "downlink.poll_interval_s",
        "downlink.poll_batch",
        "downlink.max_inbox",
        "downlink.default_ttl_s",
        "downlink.publish_timeout_s",
        "downlink.mirror_timeout_s",
        "downlink.history_s",
        "downlink.republish_rate",
        "downlink.republish_recent_s",
        "downlink.max_config_devices",
        "receipts.min_interval_ms",
        "metrics.uplink_down_unhealthy_s",
        "metrics.device_stale_s",
    }
)
SHOWN_CHARS: Final = 60


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    old: Any
    new: Any

    @property
    def live(self) -> bool:
        return self.key in LIVE

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


@dataclass(frozen=True, slots=True)
class Plan:
    live: tuple[Change, ...]
    restart: tuple[Change, ...]
    settings: Settings  # what runs after the reload

    @property
    def changed(self) -> bool:
        return bool(self.live or self.restart)


def _show(value: Any) -> str:
    if isinstance(value, SecretStr):
        return "(secret)"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _flat(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, path + "."))
        else:
            out[path] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, SecretStr) or isinstance(b, SecretStr):
        unwrap = [x.get_secret_value() if isinstance(x, SecretStr) else x for x in (a, b)]
        return bool(unwrap[0] == unwrap[1])
    return bool(a == b)


def plan(running: Settings, new: Settings) -> Plan:
    old_flat, new_flat = _flat(running.model_dump()), _flat(new.model_dump())
    changes = [
        Change(key, old_flat.get(key), new_flat.get(key))
        for key in sorted(old_flat.keys() | new_flat.keys())
        if not _same(old_flat.get(key), new_flat.get(key))
    ]
    # The default routes follow topic_prefix, which needs a restart (the
    # subscriptions and every device topic follow it too): routes moved with
    # the prefix wait for that restart, or every reading would be
    # unroutable until then.
    held = {"routes"} if running.topic_prefix != new.topic_prefix else set()
    live = tuple(c for c in changes if c.live and c.key not in held)
    update: dict[str, Any] = {}
    for c in live:
        section, _, field = c.key.partition(".")
        if not field:
            update[section] = getattr(new, section)
        else:
            update.setdefault(section, {})[field] = c.new
    settings = running.model_copy(
        update={
            section: value
            if not isinstance(value, dict)
            else getattr(running, section).model_copy(update=value)
            for section, value in update.items()
        }
    )
    return Plan(live, tuple(c for c in changes if c not in live), settings)
