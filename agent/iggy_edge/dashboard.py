"""The local dashboard: one self-contained page at ``/`` on the metrics
endpoint, and the JSON it reads.

``/``               dashboard.html: no external script, font or stylesheet
                    (gateways are often offline); it reads the two routes
                    below every 2 s and draws the plots as inline SVG
``/api/overview``   health, the live figures and the last hour of samples
``/devices``        every device heard from (devices.py), stalest first,
                    with ``stale`` set when it has been silent longer than
                    ``metrics.device_stale_s``

The last hour is a ring of `SAMPLES` samples taken every `SAMPLE_S` seconds
by `Samples.run` (about 60 kB at most), kept in the agent, not on disk:
after a restart the plots start again.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, Final

from .devices import read_extras
from .metrics import DEAD_LETTER_REASONS, DROP_REASONS, Metrics

if TYPE_CHECKING:
    from .stages import HttpView

SAMPLE_S: Final = 5.0
SAMPLES: Final = 720  # an hour
PAGE: Final = resources.files(__package__).joinpath("dashboard.html").read_bytes()


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    ingested: float
    forwarded: float
    backlog_records: float
    backlog_bytes: float
    dead_letters: float
    dropped: float


def _sample(m: Metrics) -> Sample:
    return Sample(
        t=time.time(),
        ingested=sum(m.value("iggy_edge_ingest_messages_total", qos=q) for q in "012"),
        forwarded=m.value("iggy_edge_forward_records_total"),
        backlog_records=m.value("iggy_edge_store_backlog_records"),
        backlog_bytes=m.value("iggy_edge_store_backlog_bytes"),
        dead_letters=sum(
            m.value("iggy_edge_store_dead_letters_total", reason=r) for r in DEAD_LETTER_REASONS
        ),
        dropped=sum(m.value("iggy_edge_store_dropped_records_total", reason=r) for r in DROP_REASONS),
    )


class Samples:
    def __init__(self, metrics: Metrics, maxlen: int = SAMPLES) -> None:
        self._metrics = metrics
        self.ring: deque[Sample] = deque(maxlen=maxlen)

    def take(self) -> Sample:
        s = _sample(self._metrics)
        self.ring.append(s)
        return s

    async def run(self, interval: float = SAMPLE_S) -> None:
        while True:
            self.take()
            await asyncio.sleep(interval)

    def series(self) -> list[dict[str, float]]:
        """Per interval: rates (per second) and the backlog at its end."""
        out = []
        for a, b in itertools.pairwise(self.ring):
            dt = b.t - a.t
            if dt <= 0:
                continue
            out.append(
                {
                    "t": round(b.t, 1),
                    "ingest_per_s": round(max(0.0, b.ingested - a.ingested) / dt, 2),
                    "forward_per_s": round(max(0.0, b.forwarded - a.forwarded) / dt, 2),
                    "backlog_records": b.backlog_records,
                }
            )
        return out


def overview(agent: HttpView, samples: Samples) -> dict[str, Any]:
    now = _sample(agent.metrics)
    last = samples.ring[-1] if samples.ring else None
    dt = 0.0 if last is None else now.t - last.t
    m = agent.metrics
    lag_n = m.value("iggy_edge_receipts_lag_seconds_count")
    health = agent.health()
    return {
        "gateway": agent.settings.gateway_id,
        "health": health.as_dict(),
        "figures": {
            "ingested": now.ingested,
            "forwarded": now.forwarded,
            "ingest_per_s": round((now.ingested - last.ingested) / dt, 2) if last and dt > 0 else None,
            "forward_per_s": round((now.forwarded - last.forwarded) / dt, 2) if last and dt > 0 else None,
            "backlog_records": now.backlog_records,
            "backlog_bytes": now.backlog_bytes,
            "oldest_age_s": round(m.value("iggy_edge_store_backlog_oldest_age_seconds"), 1),
            "dead_letters": now.dead_letters,
            "dropped": now.dropped,
            "receipts_lag_mean_s": round(m.value("iggy_edge_receipts_lag_seconds_sum") / lag_n, 3)
            if lag_n
            else None,
            "devices": len(agent.devices),
        },
        "series": samples.series(),
        "sample_s": SAMPLE_S,
    }


async def devices_doc(agent: HttpView) -> dict[str, Any]:
    """Every device heard from, with what the buffer, the receipts and the
    return path know of it (devices.read_extras reads the file in a thread)."""
    stale_s = agent.settings.metrics.device_stale_s
    rows = agent.devices.rows()
    held = agent.unreceipted()
    backlog = agent.backlog_by_device()
    total = agent.backlog_records
    extras = await asyncio.to_thread(
        read_extras, agent.settings.buffer_path, agent.settings.topics.head, {r["device"] for r in rows}
    )
    for row in rows:
        dev = row["device"]
        row["stale"] = row["silent_s"] > stale_s
        age = held.get(dev)
        row["unreceipted_age_s"] = None if age is None else round(age, 1)
        records, size = backlog.get(dev, (0, 0))
        row["buffered"], row["buffered_bytes"] = records, size
        row["buffer_share"] = round(records / total, 4) if total else None
        row.update(extras.get(dev, {}))
    return {"gateway": agent.settings.gateway_id, "stale_after_s": stale_s, "devices": rows}
