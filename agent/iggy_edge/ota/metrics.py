"""The updater's figures, on the agent's registry (metrics.py): registered
once per `Metrics` (the component may be restarted by the supervisor)."""

from __future__ import annotations

import weakref
from typing import Final

from prometheus_client import Counter, Gauge

from ..metrics import Metrics

OUTCOMES: Final = ("done", "rolled_back", "failed", "cancelled")
RESEND_WHY: Final = ("timeout", "bad_chunk", "reconnect", "board_idle")
REPLY_KINDS: Final = ("ok", "garbage", "stale", "no_update", "duplicate")
BOUNDS: Final = ("concurrent", "artifact", "board_busy", "reply_queue", "bad_chunks", "offers", "assembling")


class OtaMetrics:
    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.finished = Counter(
            "iggy_edge_ota_updates", "Board updates finished, by outcome", ["outcome"], registry=r
        )
        self.chunks = Counter("iggy_edge_ota_chunks_sent", "Update chunks published to boards", registry=r)
        self.chunk_bytes = Counter("iggy_edge_ota_chunk_bytes_sent", "Update bytes published", registry=r)
        self.resends = Counter(
            "iggy_edge_ota_resends", "Update messages sent again, by why", ["why"], registry=r
        )
        self.replies = Counter(
            "iggy_edge_ota_replies",
            "Messages from boards on up/ota, by kind (garbage: ignored)",
            ["kind"],
            registry=r,
        )
        self.bounds = Counter(
            "iggy_edge_ota_bound_hits",
            "Times an update bound held something back or ended it",
            ["bound"],
            registry=r,
        )
        self.active = Gauge("iggy_edge_ota_active", "Updates in progress with a board", registry=r)
        self.queued = Gauge(
            "iggy_edge_ota_queued", "Updates waiting for a slot or their rollout wave", registry=r
        )
        for o in OUTCOMES:
            self.finished.labels(o)
        for w in RESEND_WHY:
            self.resends.labels(w)
        for k in REPLY_KINDS:
            self.replies.labels(k)
        for b in BOUNDS:
            self.bounds.labels(b)


_BY_AGENT: weakref.WeakKeyDictionary[Metrics, OtaMetrics] = weakref.WeakKeyDictionary()


def ota_metrics(metrics: Metrics) -> OtaMetrics:
    found = _BY_AGENT.get(metrics)
    if found is None:
        found = _BY_AGENT[metrics] = OtaMetrics(metrics)
    return found
