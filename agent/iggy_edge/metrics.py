"""Counters and gauges of every stage, on a private Prometheus registry.

Names follow `iggy_edge_<stage>_<noun>_<unit>`; drop and error reasons are a
fixed set of label values (see the *_REASONS tuples) so dashboards and alerts
can rely on them.  The HTTP endpoint and health logic live in `httpd.py`; this
module only holds the figures so any stage (and tests) can use them without a
server.
"""

from __future__ import annotations

import time
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DROP_REASONS: Final = (
    "buffer_full_oldest",
    "buffer_full_rejected",
    "ttl_expired",
    "qos0_queue_full",
)
DEAD_LETTER_REASONS: Final = (
    *("oversize", "unroutable", "invalid_topic", "empty_payload", "too_many_topics", "too_many_devices"),
    *("invalid_command", "too_many_config_devices", "ack_wrong_device"),
)
FORWARD_ERROR_KINDS: Final = ("unavailable", "ambiguous", "rejected")
COMMAND_STATES: Final = ("received", "delivered", "acked", "expired", "failed")
DOWNLINK_ERROR_KINDS: Final = (
    *("poll", "mirror", "deliver", "ack_queue_full"),
    *("unstorable", "publish_dropped", "ack_wrong_device"),
)


class Metrics:
    """All figures of one agent.  One instance per agent (tests run several)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.started_at = time.time()
        # ingest
        self.ingest_messages = Counter(
            "iggy_edge_ingest_messages", "MQTT messages received", ["qos"], registry=r
        )
        self.ingest_bytes = Counter("iggy_edge_ingest_payload_bytes", "Payload bytes received", registry=r)
        self.mqtt_connected = Gauge(
            "iggy_edge_ingest_connected", "1 while the MQTT session is up", registry=r
        )
        self.ingest_read_pauses = Counter(
            "iggy_edge_ingest_read_pauses",
            "Times ingest stopped reading from the broker because too many records waited for commit",
            registry=r,
        )
        self.ingest_handler_errors = Counter(
            "iggy_edge_ingest_handler_errors",
            "Unexpected errors handling an MQTT message (each closed the session, which reconnected)",
            registry=r,
        )
        self.ingest_known_copies = Counter(
            "iggy_edge_ingest_known_copies",
            "Messages recognised as copies of committed ones (topic, device seq, CRC): acked, not stored",
            registry=r,
        )
        self.mqtt_sessions_lost = Counter(
            "iggy_edge_mqtt_session_lost",
            "Connects where the broker had forgotten the agent's persistent session (messages may be lost)",
            registry=r,
        )
        self.mqtt_reconnects = Counter("iggy_edge_ingest_reconnects", "MQTT reconnect attempts", registry=r)
        # store
        self.store_committed = Counter(
            "iggy_edge_store_records_committed", "Records committed to the outbox", registry=r
        )
        self.store_commit_seconds = Histogram(
            "iggy_edge_store_commit_seconds",
            "Group-commit latency",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )
        self.dropped = Counter(
            "iggy_edge_store_dropped_records",
            "Records dropped under a documented policy",
            ["reason"],
            registry=r,
        )
        self.dead_letters = Counter(
            "iggy_edge_store_dead_letters",
            "Messages moved to the dead-letter table",
            ["reason"],
            registry=r,
        )
        self.backlog_records = Gauge(
            "iggy_edge_store_backlog_records", "Records waiting in the outbox", registry=r
        )
        self.backlog_bytes = Gauge(
            "iggy_edge_store_backlog_bytes", "Accounted bytes in the outbox", registry=r
        )
        self.dead_letter_bytes = Gauge(
            "iggy_edge_store_dead_letter_bytes",
            "Accounted bytes of the dead letters (bounded by buffer.max_dead_letter_bytes)",
            registry=r,
        )
        self.devices_tracked = Gauge(
            "iggy_edge_store_devices", "Devices the buffer tracks (bounded by buffer.max_devices)", registry=r
        )
        self.backlog_oldest_age = Gauge(
            "iggy_edge_store_backlog_oldest_age_seconds",
            "Age of the oldest outbox record",
            registry=r,
        )
        self.store_errors = Counter("iggy_edge_store_errors", "SQLite errors", registry=r)
        # damaged buffers (store/recovery/)
        self.store_moved_aside = Counter(
            "iggy_edge_store_moved_aside", "Damaged buffer files moved aside", registry=r
        )
        self.store_salvaged = Counter(
            "iggy_edge_store_salvaged_records", "Records salvaged from a damaged buffer", registry=r
        )
        self.store_unreadable = Counter(
            "iggy_edge_store_unreadable_records",
            "Records that could not be read from a damaged buffer",
            registry=r,
        )
        self.store_wal_damaged = Counter(
            "iggy_edge_store_wal_damaged", "WAL files with a damaged header (copied aside)", registry=r
        )
        self.store_wal_frames_lost = Counter(
            "iggy_edge_store_wal_lost_frames", "WAL frames SQLite ignored behind a damaged header", registry=r
        )
        # forward
        self.forwarded = Counter("iggy_edge_forward_records", "Records confirmed by Iggy", registry=r)
        self.forward_batches = Counter("iggy_edge_forward_batches", "Batches confirmed by Iggy", registry=r)
        self.forward_errors = Counter("iggy_edge_forward_errors", "Failed sends", ["kind"], registry=r)
        self.forward_ambiguous_retries = Counter(
            "iggy_edge_forward_ambiguous_retries",
            "Records re-sent after an ambiguous failure (possible duplicates, same ids)",
            registry=r,
        )
        self.forward_resent = Counter(
            "iggy_edge_forward_resent_records",
            "Records sent again because their delete after a confirmed send failed (same ids)",
            registry=r,
        )
        self.forward_send_seconds = Histogram(
            "iggy_edge_forward_send_seconds",
            "Time for Iggy to confirm a batch",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.uplink_up = Gauge("iggy_edge_forward_uplink_up", "1 while the last send succeeded", registry=r)
        self.uplink_down_since = Gauge(
            "iggy_edge_forward_uplink_down_since_seconds",
            "Unix time the uplink went down, 0 when up",
            registry=r,
        )
        # return path
        self.commands = Counter(
            "iggy_edge_downlink_commands", "Commands by state transition", ["state"], registry=r
        )
        self.inbox_records = Gauge(
            "iggy_edge_downlink_inbox_records", "Commands waiting for delivery", registry=r
        )
        self.downlink_inbox_full = Counter(
            "iggy_edge_downlink_inbox_full",
            "Command polls skipped because the inbox was full (the commands stay in Iggy)",
            registry=r,
        )
        self.downlink_errors = Counter(
            "iggy_edge_downlink_errors", "Return-path failures", ["kind"], registry=r
        )
        self.config_republished = Counter(
            "iggy_edge_config_republished",
            "Desired configs published retained again (restore after the broker lost them, or on demand)",
            registry=r,
        )
        # the supervisor (supervisor.py)
        self.stage_restarts = Counter(
            "iggy_edge_agent_stage_restarts",
            "Times a stage failed unexpectedly and was restarted by the supervisor",
            ["stage"],
            registry=r,
        )
        # receipts (receipts.py; the per-device gauges come from its collector)
        self.receipts_sent = Counter("iggy_edge_receipts_sent", "Receipts published to devices", registry=r)
        self.receipts_lag = Histogram(
            "iggy_edge_receipts_lag_seconds",
            "From a reading being durable (committed, or confirmed by Iggy) to the receipt covering it",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0),
            registry=r,
        )
        for kind in DOWNLINK_ERROR_KINDS:
            self.downlink_errors.labels(kind)
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
        for reason in DEAD_LETTER_REASONS:
            self.dead_letters.labels(reason)
        for kind in FORWARD_ERROR_KINDS:
            self.forward_errors.labels(kind)
        for state in COMMAND_STATES:
            self.commands.labels(state)
        for qos in ("0", "1", "2"):
            self.ingest_messages.labels(qos)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (for `status`, tests and benchmarks)."""
        got = self.registry.get_sample_value(name, labels or None)
        return 0.0 if got is None else float(got)
