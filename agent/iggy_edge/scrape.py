"""A running agent's figures, as `iggy-edge status` shows them: read from
its /health and /metrics (the figures Prometheus scrapes: one source of
truth), after checking that the endpoint is this gateway's agent (/health
names the gateway, the buffer path and the buffer's instance id, random per
database file).  What the buffer file holds comes from SQLite.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .buffer_admin import read_stats
from .config import Settings
from .store import StoreError


class NotOurs(Exception):
    """What answers at the endpoint is not this gateway's agent."""


@dataclass
class Snapshot:
    """One scrape: sample name (+ sorted labels) -> value, and the health doc."""

    at: float
    samples: dict[str, float] = field(default_factory=dict)
    by_label: dict[str, dict[str, float]] = field(default_factory=dict)
    health: dict[str, Any] = field(default_factory=dict)
    healthy: bool = False

    def get(self, name: str) -> float:
        return self.samples.get(name, 0.0)

    def labelled(self, name: str) -> dict[str, float]:
        return self.by_label.get(name, {})


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    plain: dict[str, float] = {}
    labelled: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels and not s.name.endswith("_bucket"):
                label = ",".join(str(v) for _, v in sorted(s.labels.items()))
                labelled.setdefault(s.name, {})[label] = float(s.value)
                plain[s.name] = plain.get(s.name, 0.0) + float(s.value)  # total over labels
            elif not s.labels:
                plain[s.name] = float(s.value)
    return plain, labelled


def read_instance(path: Any) -> str | None:
    """The buffer database's instance id (its `epoch`), None when unreadable."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    return None if row is None else str(row[0])


def identity_problem(health: Any, settings: Settings, instance: str | None) -> str | None:
    """Why the /health document is not this gateway's agent, or None."""
    if not isinstance(health, dict) or "gateway" not in health or "buffer" not in health:
        return "it is not an iggy-edge agent (its /health names no gateway and buffer)"
    if health["gateway"] != settings.gateway_id:
        return f"it is gateway {health['gateway']!r}, this config is {settings.gateway_id!r}"
    ours = str(settings.buffer_path.absolute())
    if health["buffer"] != ours:
        return f"its buffer is {health['buffer']!r}, this config's is {ours!r}"
    if instance is not None and health.get("instance") not in (None, instance):
        return f"its buffer instance is {health.get('instance')!r}, the file at {ours} is {instance!r}"
    return None


def scrape(base_url: str, settings: Settings | None = None, timeout: float = 3.0) -> Snapshot:
    """Read /health, check it is `settings`' agent (raises NotOurs), then
    /metrics; raises OSError when nothing answers."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as resp:  # noqa: S310 - http URL
            body, healthy = resp.read(), True
    except urllib.error.HTTPError as e:  # 503 carries the same JSON
        body, healthy = e.read() or b"{}", False
    try:
        health = json.loads(body)
    except ValueError:
        raise NotOurs("it is not an iggy-edge agent (/health is not JSON)") from None
    if settings is not None:
        problem = identity_problem(health, settings, read_instance(settings.buffer_path))
        if problem:
            raise NotOurs(problem)
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:  # noqa: S310
        text = resp.read().decode("utf-8", "replace")
    try:
        plain, labelled = parse_metrics(text)
    except ValueError as e:
        raise NotOurs(f"its /metrics is not Prometheus text ({e})") from None
    return Snapshot(time.monotonic(), plain, labelled, health, healthy)


def figures(snap: Snapshot, prev: Snapshot | None = None) -> dict[str, Any]:
    """The figures status shows, as a JSON-ready dict (rates need `prev`)."""
    g = snap.get
    ingested = g("iggy_edge_ingest_messages_total")
    forwarded = g("iggy_edge_forward_records_total")
    sends = g("iggy_edge_forward_send_seconds_count")
    out: dict[str, Any] = {
        "healthy": snap.healthy,
        "health": snap.health,
        "ingest": {
            "connected": bool(g("iggy_edge_ingest_connected")),
            "messages": int(ingested),
            "payload_bytes": int(g("iggy_edge_ingest_payload_bytes_total")),
            "reconnects": int(g("iggy_edge_ingest_reconnects_total")),
            "sessions_lost": int(g("iggy_edge_mqtt_session_lost_total")),
        },
        "store": {
            "committed": int(g("iggy_edge_store_records_committed_total")),
            "backlog_records": int(g("iggy_edge_store_backlog_records")),
            "backlog_bytes": int(g("iggy_edge_store_backlog_bytes")),
            "dead_letter_bytes": int(g("iggy_edge_store_dead_letter_bytes")),
            "devices": int(g("iggy_edge_store_devices")),
            "oldest_age_s": round(g("iggy_edge_store_backlog_oldest_age_seconds"), 1),
            "dropped": {k: int(v) for k, v in snap.labelled("iggy_edge_store_dropped_records_total").items()},
            "dead_letters": {
                k: int(v) for k, v in snap.labelled("iggy_edge_store_dead_letters_total").items()
            },
            "errors": int(g("iggy_edge_store_errors_total")),
        },
        "forward": {
            "uplink_up": bool(g("iggy_edge_forward_uplink_up")),
            "records": int(forwarded),
            "batches": int(g("iggy_edge_forward_batches_total")),
            "errors": {k: int(v) for k, v in snap.labelled("iggy_edge_forward_errors_total").items()},
            "ambiguous_retries": int(g("iggy_edge_forward_ambiguous_retries_total")),
            "mean_send_ms": round(1000 * g("iggy_edge_forward_send_seconds_sum") / sends, 2)
            if sends
            else None,
        },
        "downlink": {
            "commands": {k: int(v) for k, v in snap.labelled("iggy_edge_downlink_commands_total").items()},
            "inbox_records": int(g("iggy_edge_downlink_inbox_records")),
        },
    }
    if prev is not None and snap.at > prev.at:
        dt = snap.at - prev.at
        out["rates"] = {
            "ingest_per_s": round((ingested - prev.get("iggy_edge_ingest_messages_total")) / dt, 1),
            "forward_per_s": round((forwarded - prev.get("iggy_edge_forward_records_total")) / dt, 1),
        }
    return out


def stored(settings: Settings) -> dict[str, Any]:
    """What the buffer file holds (the counters count only since the agent
    started: after a restart they say none while dead letters are stored)."""
    try:
        st = read_stats(settings.buffer_path)
    except StoreError:
        return {}
    return {
        "stored": {
            "dead_letters": st.dead_letters,
            "dead_letters_by_reason": st.dead_letters_by_reason,
            "records": st.records,
        }
    }
