"""Updates requested by the cloud side through Iggy (docs/return-path.md,
"Board updates").

The cloud side writes to this gateway's own topic ``ota.{gateway_id}``
(stream `downlink.stream`, partition 0), in order: the artifact's bundle
(artifact.py) as chunk messages, then the request that names it by its
sha256.  Every message is one JSON header line, ``\\n``, then (chunks
only) the bytes:

* ``{"t":"chunk","artifact":SHA,"i":k,"n":N,"h":SHA_OF_THESE_BYTES}``
  (`CLOUD_CHUNK_BYTES` at most; k from 0 to N-1),
* ``{"t":"update","artifact":SHA,"devices":[...],"canary":C,"max_failures":F}``.

Untrusted: each chunk is checked against its ``h``, the whole bundle
against the artifact's sha256 and every bound (artifact.from_bundle),
before it is kept; a bad message is logged, counted and skipped.  Read
with a look first (the topic's newest offset) and a poll only when there is
news, every 5 s while idle.  At most
`MAX_ASSEMBLING` artifacts are put together at once (the oldest goes).  The
offset is kept in ota.db only when no artifact is half read, so a restart
reads the chunks of an unfinished one again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Final

from ..config import Settings
from ..device_ids import device_id_problem
from ..logs import RateLimitedLog
from ..uplink.protocol import CommandSource, UplinkError, UplinkRejected
from . import requests as req
from .artifact import MAX_ARTIFACT_BYTES, Artifact, ArtifactError, from_bundle
from .metrics import OtaMetrics
from .protocol import sha256_hex

log = logging.getLogger(__name__)

CLOUD_CHUNK_BYTES: Final = 60 * 1024
MAX_ASSEMBLING: Final = 2
POLL_BATCH: Final = 16
PARTITION: Final = 0
LOOK_INTERVAL_S: Final = 5.0  # requests are not latency-critical
_OFFSETS = (
    "CREATE TABLE IF NOT EXISTS ota_cloud_offset (topic TEXT PRIMARY KEY, last_offset INTEGER NOT NULL)"
)


def ota_topic(settings: Settings) -> str:
    return f"ota.{settings.gateway_id}"


def _line(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def cloud_messages(
    art: Artifact, devices: list[str], *, canary: int = 0, max_failures: int = 0
) -> list[bytes]:
    """What the cloud side writes, in order, to request `art` on `devices`."""
    bundle = art.bundle()
    parts = [bundle[i : i + CLOUD_CHUNK_BYTES] for i in range(0, len(bundle), CLOUD_CHUNK_BYTES)]
    out = [
        _line({"t": "chunk", "artifact": art.id, "i": i, "n": len(parts), "h": sha256_hex(p)}) + p
        for i, p in enumerate(parts)
    ]
    out.append(
        _line(
            {
                "t": "update",
                "artifact": art.id,
                "devices": devices,
                "canary": canary,
                "max_failures": max_failures,
            }
        )
    )
    return out


def waves(devices: list[str], canary: int) -> list[list[str]]:
    if 0 < canary < len(devices):
        return [devices[:canary], devices[canary:]]
    return [devices]


class CloudRequests:
    def __init__(
        self,
        settings: Settings,
        source: CommandSource,
        metrics: OtaMetrics,
        max_artifact_bytes: int = MAX_ARTIFACT_BYTES,
    ) -> None:
        self._stream = settings.downlink.stream
        self._topic = ota_topic(settings)
        self._db = req.db_path(settings.state_dir)
        self._source = source
        self._m = metrics
        self._max = max_artifact_bytes
        self._interval = settings.downlink.poll_interval_s
        self._parts: dict[str, dict[int, bytes]] = {}  # artifact -> chunk index -> bytes
        self._limited = RateLimitedLog(log)

    async def run(self) -> None:
        """Look (the topic's newest offset), poll only when there is news, every
        `LOOK_INTERVAL_S` while idle: an idle gateway costs Iggy one small
        request per interval, and none of the return poll's cadence."""
        last = await asyncio.to_thread(self._load_offset)
        looks = True  # False once the server refused a look: poll instead
        while True:
            try:
                if looks and not await self._news(last):
                    await asyncio.sleep(LOOK_INTERVAL_S)
                    continue
            except UplinkRejected as e:  # a user that may poll but not read topic details
                looks = False
                log.info(
                    "ota: %s/%s: the look was refused (%s); polling instead", self._stream, self._topic, e
                )
            except UplinkError as e:
                self._limited.warning(
                    "ota-cloud-look", "ota: cannot look at %s/%s: %s", self._stream, self._topic, e
                )
                await asyncio.sleep(LOOK_INTERVAL_S)
                continue
            try:
                messages = await self._source.poll(self._stream, self._topic, PARTITION, last + 1, POLL_BATCH)
            except UplinkError as e:  # with looks off, a missing topic says so here
                self._limited.warning(
                    "ota-cloud-poll", "ota: cannot read %s/%s: %s", self._stream, self._topic, e
                )
                await asyncio.sleep(LOOK_INTERVAL_S)
                continue
            for m in messages:
                await self._take(m.payload, m.offset)
                last = m.offset
                if not self._parts:
                    await asyncio.to_thread(self._store_offset, last)
            if len(messages) < POLL_BATCH:
                await asyncio.sleep(self._interval if self._parts else LOOK_INTERVAL_S)

    async def _news(self, last: int) -> bool:
        newest = await self._source.last_offsets(self._stream, self._topic)
        return newest is not None and newest.get(PARTITION, -1) > last

    async def _take(self, payload: bytes, offset: int) -> None:
        head, _, body = payload.partition(b"\n")
        try:
            doc = json.loads(head)
            kind = doc["t"]
            if kind == "chunk":
                await self._chunk(doc, body)
            elif kind == "update":
                await self._update(doc)
            else:
                raise ValueError(f"unknown kind {str(kind)[:20]!r}")  # noqa: TRY301
        except (ValueError, KeyError, TypeError, req.BoardBusy) as e:
            self._m.bounds.labels("board_busy" if isinstance(e, req.BoardBusy) else "artifact").inc()
            self._limited.warning(
                "ota-cloud", "ota: %s/%s offset %d refused: %s", self._stream, self._topic, offset, e
            )

    async def _chunk(self, doc: dict[str, Any], body: bytes) -> None:
        aid, i, n, h = str(doc["artifact"]), doc["i"], doc["n"], doc["h"]
        if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n) or n * CLOUD_CHUNK_BYTES > 2 * (
            self._max + 8192
        ):
            raise ValueError("bad chunk index or count")
        if len(body) > CLOUD_CHUNK_BYTES or sha256_hex(body) != h:
            raise ValueError(f"chunk {i} of artifact {aid[:12]}: sha256 mismatch or too long")
        parts = self._parts.setdefault(aid, {})
        while len(self._parts) > MAX_ASSEMBLING:
            dropped = next(iter(self._parts))
            del self._parts[dropped]
            self._m.bounds.labels("artifact").inc()
            log.warning(
                "ota: dropped the unfinished artifact %s (at most %d at once)", dropped[:12], MAX_ASSEMBLING
            )
        parts[i] = body
        if len(parts) < n:
            return
        bundle = b"".join(parts[k] for k in range(n))
        del self._parts[aid]
        if sha256_hex(bundle) != aid:
            raise ValueError(f"artifact {aid[:12]}: the bundle's sha256 differs")
        try:
            art = from_bundle(bundle, max_bytes=self._max)
        except ArtifactError as e:
            raise ValueError(f"artifact {aid[:12]}: {e}") from None
        await asyncio.to_thread(self._put, art)
        log.info(
            "ota: artifact %s (version %s, %d bytes) received from the cloud side",
            aid[:12],
            art.version,
            art.total,
        )

    async def _update(self, doc: dict[str, Any]) -> None:
        devices = doc["devices"]
        if not isinstance(devices, list) or not all(
            isinstance(d, str) and device_id_problem(d) is None for d in devices
        ):
            raise ValueError("devices must be a list of device ids")
        canary, max_failures = int(doc.get("canary", 0)), int(doc.get("max_failures", 0))
        done = await asyncio.to_thread(
            self._request, str(doc["artifact"]), waves(devices, canary), max_failures
        )
        log.info("ota: the cloud side requested rollout %s on %d board(s)", done.rollout, len(done.updates))

    # -- ota.db, in a thread ------------------------------------------------------

    def _conn(self) -> Any:
        conn = req.connect(self._db)
        conn.execute(_OFFSETS)
        return conn

    def _load_offset(self) -> int:
        conn = self._conn()
        try:
            row = conn.execute(
                "SELECT last_offset FROM ota_cloud_offset WHERE topic = ?", (self._topic,)
            ).fetchone()
            return -1 if row is None else int(row[0])
        finally:
            conn.close()

    def _store_offset(self, offset: int) -> None:
        conn = self._conn()
        try:
            conn.execute("INSERT OR REPLACE INTO ota_cloud_offset VALUES (?, ?)", (self._topic, offset))
        finally:
            conn.close()

    def _put(self, art: Artifact) -> None:
        conn = self._conn()
        try:
            req.put_artifact(conn, art)
        finally:
            conn.close()

    def _request(self, aid: str, w: list[list[str]], max_failures: int) -> req.Requested:
        conn = self._conn()
        try:
            return req.request(conn, aid, w, max_failures=max_failures, source="cloud")
        finally:
            conn.close()
