"""Updates requested by the cloud side through the return path
(docs/return-path.md, "Board updates from the cloud side").

The cloud side writes to the gateway's one return-path topic
(`return_topic_of`: ``return.<gw>`` in stream ``edge-rp-<n>``, partition 0;
`send_update` does it), each message with the user header ``kind = ota``,
in order: the artifact's bundle (artifact.py) as chunk messages, then the
request that names it by its sha256.  Every message is one JSON header
line, ``\\n``, then (chunks only) the bytes:

* ``{"t":"chunk","artifact":SHA,"i":k,"n":N,"h":SHA_OF_THESE_BYTES}``
  (`CLOUD_CHUNK_BYTES` at most; k from 0 to N-1),
* ``{"t":"update","artifact":SHA,"devices":[...],"canary":C,"max_failures":F}``.

The return poll (downlink/poll.py) reads them with the commands and configs,
in the same polls (no request of its own), and hands each to
`CloudRequests.take`, which stores it in ``ota.db`` (committed) before the
poll commits the offset: a crash re-reads it, and the offset kept with it
here (`ota_cloud_offset`) says it was taken, so nothing is lost or taken
twice.  Untrusted: each chunk is checked against its ``h``, the whole bundle
against the artifact's sha256 and every bound (artifact.from_bundle) before
the artifact is kept; a bad message is refused with a reason (the poll
dead-letters it), counted and logged rate-limited, and never stops the poll.

Bounds (policy): a chunk of at most `CLOUD_CHUNK_BYTES`, at most enough
chunks for the artifact bound; at most `MAX_ASSEMBLING` artifacts half
received at once, their chunks on disk (``ota_cloud_chunks``): a chunk of a
further one drops the oldest unfinished one (counted as
``iggy_edge_ota_bound_hits_total{bound="assembling"}``, logged).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from typing import Any, Final, Protocol

from ..config import DownlinkSettings, Settings
from ..device_ids import device_id_problem
from ..downlink.commands import KIND_HEADER, KIND_OTA, Refused, printable, return_topic_of
from ..logs import RateLimitedLog
from . import requests as req
from .artifact import MAX_ARTIFACT_BYTES, Artifact, ArtifactError, from_bundle
from .metrics import OtaMetrics
from .protocol import sha256_hex

log = logging.getLogger(__name__)

CLOUD_CHUNK_BYTES: Final = 60 * 1024
MAX_ASSEMBLING: Final = 2
INVALID_OTA: Final = "invalid_ota"  # dead-letter reason: not a usable ota message
OTA_BOARD_BUSY: Final = "ota_board_busy"  # dead-letter reason: a named board has an active update
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS ota_cloud_offset (topic TEXT PRIMARY KEY, last_offset INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS ota_cloud_chunks (
    artifact TEXT NOT NULL, i INTEGER NOT NULL, n INTEGER NOT NULL, data BLOB NOT NULL,
    at REAL NOT NULL, PRIMARY KEY (artifact, i));
"""


def cloud_headers() -> dict[str, str]:
    """The Iggy user headers of every message `cloud_messages` makes."""
    return {KIND_HEADER: KIND_OTA}


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
    request = {"t": "update", "artifact": art.id, "devices": devices}
    out.append(_line({**request, "canary": canary, "max_failures": max_failures}))
    return out


class Sink(Protocol):
    async def publish(
        self,
        stream: str,
        topic: str,
        partition_id: int,
        payload: bytes,
        headers: dict[str, str] | None = None,
    ) -> int | None: ...


async def send_update(
    sink: Sink,
    gateway_id: str,
    downlink: DownlinkSettings,
    art: Artifact,
    devices: list[str],
    *,
    canary: int = 0,
    max_failures: int = 0,
) -> list[int | None]:
    """The cloud side's writer: `cloud_messages` to the gateway's return-path
    topic (the addressing of ``command send``) with ``kind = ota``; the offsets."""
    rt = return_topic_of(gateway_id, downlink)
    msgs = cloud_messages(art, devices, canary=canary, max_failures=max_failures)
    return [await sink.publish(rt.stream, rt.topic, rt.partition, m, cloud_headers()) for m in msgs]


def waves(devices: list[str], canary: int) -> list[list[str]]:
    if 0 < canary < len(devices):
        return [devices[:canary], devices[canary:]]
    return [devices]


class _Refusal(Exception):
    def __init__(self, detail: str, reason: str = INVALID_OTA, bound: str = "artifact") -> None:
        super().__init__(detail)
        self.reason, self.bound = reason, bound


class CloudRequests:
    """The return poll's `OtaSink`: ``kind = ota`` messages -> ``ota.db``."""

    def __init__(
        self, settings: Settings, metrics: OtaMetrics, max_artifact_bytes: int = MAX_ARTIFACT_BYTES
    ) -> None:
        self._db = req.db_path(settings.state_dir)
        self._m = metrics
        self._max = max_artifact_bytes
        self._limited = RateLimitedLog(log)

    async def take(self, payload: bytes, stream: str, topic: str, offset: int) -> Refused | None:
        """Store one message durably (None) or say why it is refused; never
        raises for what the message holds (a disk fault propagates, and the
        poll does not commit the offset)."""
        return await asyncio.to_thread(self._take, payload, f"{stream}/{topic}", offset)

    def _take(self, payload: bytes, where: str, offset: int) -> Refused | None:
        conn = req.connect(self._db)
        try:
            conn.executescript(_SCHEMA)
            row = conn.execute(
                "SELECT last_offset FROM ota_cloud_offset WHERE topic = ?", (where,)
            ).fetchone()
            if row is not None and offset <= int(row[0]):
                return None  # taken before a crash made the poll read it again
            try:
                self._handle(conn, payload, where, offset)
            except _Refusal as e:
                self._offset(conn, where, offset)
                self._m.bounds.labels(e.bound).inc()
                self._limited.warning(
                    f"ota-cloud:{e.reason}", "ota: %s offset %d refused: %s", where, offset, e
                )
                return Refused(e.reason, printable(str(e)))
            return None
        finally:
            conn.close()

    @staticmethod
    def _offset(conn: sqlite3.Connection, where: str, offset: int) -> None:
        conn.execute("INSERT OR REPLACE INTO ota_cloud_offset VALUES (?, ?)", (where, offset))

    def _handle(self, conn: sqlite3.Connection, payload: bytes, where: str, offset: int) -> None:
        head, _, body = payload.partition(b"\n")
        try:
            doc = json.loads(head)
            kind = doc["t"] if isinstance(doc, dict) else None
        except (ValueError, KeyError) as e:
            raise _Refusal(f"not an ota message: {type(e).__name__}") from None
        if kind == "chunk":
            self._chunk(conn, doc, body, where, offset)
        elif kind == "update":
            self._update(conn, doc, where, offset)
        else:
            raise _Refusal(f"unknown ota message {str(kind)[:20]!r} (expected 'chunk' or 'update')")

    def _chunk(
        self, conn: sqlite3.Connection, doc: dict[str, Any], body: bytes, where: str, offset: int
    ) -> None:
        aid, i, n, h = doc.get("artifact"), doc.get("i"), doc.get("n"), doc.get("h")
        if not (isinstance(aid, str) and len(aid) == 64 and isinstance(h, str)):
            raise _Refusal("a chunk needs 'artifact' (a sha256) and 'h'")
        if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n) or n * CLOUD_CHUNK_BYTES > 2 * (
            self._max + 8192
        ):
            raise _Refusal("bad chunk index or count")
        if len(body) > CLOUD_CHUNK_BYTES or sha256_hex(body) != h:
            raise _Refusal(f"chunk {i} of artifact {aid[:12]}: sha256 mismatch or too long")
        conn.execute("BEGIN IMMEDIATE")
        try:
            known = conn.execute(
                "SELECT n FROM ota_cloud_chunks WHERE artifact = ? LIMIT 1", (aid,)
            ).fetchone()
            if known is not None and int(known[0]) != n:
                raise _Refusal(f"chunk {i} of artifact {aid[:12]}: n = {n}, its other chunks say {known[0]}")  # noqa: TRY301
            if known is None:
                self._evict(conn)
            conn.execute(
                "INSERT OR REPLACE INTO ota_cloud_chunks VALUES (?, ?, ?, ?, ?)",
                (aid, i, n, body, time.time()),
            )
            held = conn.execute(
                "SELECT COUNT(*) FROM ota_cloud_chunks WHERE artifact = ?", (aid,)
            ).fetchone()[0]
            if held < n:
                self._offset(conn, where, offset)  # with the chunk: taken
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if held == n:  # the offset only once the artifact is kept: a crash before re-reads this chunk
            parts = conn.execute(
                "SELECT data FROM ota_cloud_chunks WHERE artifact = ? ORDER BY i", (aid,)
            ).fetchall()
            self._assemble(conn, aid, b"".join(p[0] for p in parts))
            self._offset(conn, where, offset)

    def _evict(self, conn: sqlite3.Connection) -> None:
        """A new artifact: drop the oldest unfinished ones beyond MAX_ASSEMBLING - 1."""
        old = conn.execute(
            "SELECT artifact FROM ota_cloud_chunks GROUP BY artifact ORDER BY MIN(at) DESC LIMIT -1 OFFSET ?",
            (MAX_ASSEMBLING - 1,),
        ).fetchall()
        for (dropped,) in old:
            conn.execute("DELETE FROM ota_cloud_chunks WHERE artifact = ?", (dropped,))
            self._m.bounds.labels("assembling").inc()
            self._limited.warning(
                "ota-cloud-assembling",
                "ota: dropped the unfinished artifact %s (at most %d half received at once)",
                dropped[:12],
                MAX_ASSEMBLING,
            )

    def _assemble(self, conn: sqlite3.Connection, aid: str, bundle: bytes) -> None:
        try:
            if sha256_hex(bundle) != aid:
                raise _Refusal(f"artifact {aid[:12]}: the bundle's sha256 differs")
            try:
                art = from_bundle(bundle, max_bytes=self._max)
            except ArtifactError as e:
                raise _Refusal(f"artifact {aid[:12]}: {e}") from None
            req.put_artifact(conn, art)
        finally:
            conn.execute("DELETE FROM ota_cloud_chunks WHERE artifact = ?", (aid,))
        log.info(
            "ota: artifact %s (version %s, %d bytes) received from the cloud side",
            aid[:12],
            art.version,
            art.total,
        )

    def _update(self, conn: sqlite3.Connection, doc: dict[str, Any], where: str, offset: int) -> None:
        aid, devices = doc.get("artifact"), doc.get("devices")
        canary, max_failures = doc.get("canary", 0), doc.get("max_failures", 0)
        if not isinstance(aid, str):
            raise _Refusal("an update needs 'artifact'")
        if not isinstance(devices, list) or not all(
            isinstance(d, str) and device_id_problem(d) is None for d in devices
        ):
            raise _Refusal("devices must be a list of device ids")
        if not all(
            isinstance(x, int) and 0 <= x <= req.MAX_DEVICES_PER_REQUEST for x in (canary, max_failures)
        ):
            raise _Refusal("canary and max_failures must be whole numbers from 0")
        source = f"cloud {where}@{offset}"
        if conn.execute("SELECT 1 FROM ota_rollouts WHERE source = ?", (source,)).fetchone() is None:
            try:
                done = req.request(
                    conn, aid, waves(devices, canary), max_failures=max_failures, source=source
                )
            except req.BoardBusy as e:
                raise _Refusal(str(e), OTA_BOARD_BUSY, "board_busy") from None
            except ValueError as e:
                raise _Refusal(str(e)) from None
            log.info(
                "ota: the cloud side requested rollout %s on %d board(s)", done.rollout, len(done.updates)
            )
        self._offset(conn, where, offset)
