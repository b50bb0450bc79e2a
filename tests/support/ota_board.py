"""A scripted board for the gateway's OTA tests: a stand-in at the boundary
we own (the ``down/ota`` / ``up/ota`` contract, docs/ota.md), not the real
device library.

It is a real MQTT client (gmqtt) on the real broker, following the
contract: a probe gets ``idle`` with its version and .mpy version, a
manifest gets ``need`` (or ``failed`` over its size bound), each chunk is
checked against its sha256 (``bad`` when it differs), each file against the
manifest's, then ``staged``, and after a pretend reboot ``trial`` and
``done`` (or ``rolled_back`` when told to fail).  Its "flash" (`Flash`)
outlives a disconnect, so a reconnect resumes from what it holds.  Knobs let
a test corrupt a chunk, go silent, or ignore messages.  The lead's
end-to-end tests run the real MicroPython board instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import gmqtt
from gmqtt.mqtt.constants import MQTTv311


@dataclass
class Flash:
    """What survives the board's reconnects: its version and staging area."""

    version: str = "v0"
    staging_id: str | None = None
    manifest: dict[str, Any] | None = None
    files: list[bytearray] = field(default_factory=list)
    installed: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Script:
    """What the board does differently from a good board."""

    mpy: int = 6
    max_total: int = 256 * 1024
    corrupt: set[tuple[int, int]] = field(default_factory=set)  # (f, o) to flip a byte of, once each
    rollback_why: str | None = None  # after the switch: roll back with this reason
    deaf_chunks: int = 0  # ignore this many chunks (no reply): the gateway's timer must resend
    silent: bool = False  # answer nothing at all
    switch_delay_s: float = 0.1
    lose_verdict: bool = False  # the "done" after the switch never reaches the gateway
    chunk_delay_s: float = 0.0  # a slow flash: each chunk's answer comes this much later
    n: int | None = None  # the most data bytes it takes in one chunk (its need says so)
    duplicate_needs: bool = False  # every need is sent twice (as a board greeting a session does)


class ScriptedBoard:
    def __init__(
        self, host: str, port: int, device: str, prefix: str = "edge", script: Script | None = None
    ) -> None:
        self.host, self.port, self.device, self.prefix = host, port, device, prefix
        self.script = script or Script()
        self.flash = Flash()
        self.received: list[dict[str, Any]] = []  # every header line from down/ota
        self.chunks: dict[tuple[int, int], int] = {}  # (f, o) -> times received
        self.replies: list[dict[str, Any]] = []
        self.first_at: float | None = None  # loop time of the first message on down/ota
        self.staged_at: float | None = None  # ... of the reply "staged"
        self.bytes_in = 0  # payload bytes received on down/ota
        self.oversized = 0  # chunks longer than the board's n
        self._client: gmqtt.Client | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def manifests(self) -> int:
        return sum(1 for m in self.received if m.get("t") == "m")

    async def start(self) -> ScriptedBoard:
        client = gmqtt.Client(self.device, clean_session=True)
        client.set_config({"reconnect_retries": 0})
        client.on_message = self._on_message
        status = f"{self.prefix}/{self.device}/status"
        client._will_message = gmqtt.Message(status, b"offline", qos=1, retain=True)  # noqa: SLF001 - test board
        await client.connect(self.host, self.port, version=MQTTv311)
        client.subscribe(f"{self.prefix}/{self.device}/down/ota", qos=1)
        await asyncio.sleep(0.05)
        client.publish(status, b"online", qos=1, retain=True)
        self._client = client
        return self

    async def stop(self) -> None:
        """A clean disconnect (the flash stays)."""
        client, self._client = self._client, None
        for t in list(self._tasks):
            t.cancel()
        if client is not None:
            with contextlib.suppress(Exception):
                client.publish(f"{self.prefix}/{self.device}/status", b"offline", qos=1, retain=True)
                await asyncio.sleep(0.05)
                await client.disconnect()

    def reply(self, doc: dict[str, Any]) -> None:
        if doc.get("st") == "staged" and self.staged_at is None:
            self.staged_at = asyncio.get_running_loop().time()
        self.replies.append(doc)
        if self._client is not None:
            self._client.publish(f"{self.prefix}/{self.device}/up/ota", json.dumps(doc).encode(), qos=1)

    def publish_raw(self, payload: bytes) -> None:
        assert self._client is not None
        self._client.publish(f"{self.prefix}/{self.device}/up/ota", payload, qos=1)

    # -- the contract ---------------------------------------------------------

    def _on_message(self, client: Any, topic: str, payload: bytes, qos: int, props: Any) -> int:
        if self.first_at is None:
            self.first_at = asyncio.get_running_loop().time()
        self.bytes_in += len(payload)
        head, _, body = payload.partition(b"\n")
        doc = json.loads(head)
        self.received.append(doc)
        if self.script.silent:
            return 0
        kind = doc.get("t")
        if kind == "q":
            self._probe()
        elif kind == "m":
            self._manifest(doc)
        elif kind == "c":
            self._chunk(doc, body)
        elif kind == "x":
            self.flash.staging_id, self.flash.manifest, self.flash.files = None, None, []
            self.reply({"id": doc["id"], "st": "failed", "why": "aborted"})
        return 0

    def _probe(self) -> None:
        fl = self.flash
        if fl.staging_id is not None and fl.manifest is not None:
            self._need_next()
        else:
            self.reply({"st": "idle", "v": fl.version, "mpy": self.script.mpy})

    def _manifest(self, doc: dict[str, Any]) -> None:
        fl = self.flash
        if doc["total"] > self.script.max_total:
            self.reply({"id": doc["id"], "st": "failed", "why": f"too big: {doc['total']} bytes"})
            return
        if fl.staging_id != doc["id"]:  # a new update: empty staging area
            fl.staging_id, fl.manifest = doc["id"], doc
            fl.files = [bytearray() for _ in doc["files"]]
        self._need_next()

    def _need_next(self) -> None:
        fl = self.flash
        assert fl.manifest is not None
        for i, (_, size, _) in enumerate(fl.manifest["files"]):
            if len(fl.files[i]) < size:
                need: dict[str, Any] = {"id": fl.staging_id, "st": "need", "f": i, "o": len(fl.files[i])}
                if self.script.n is not None:
                    need["n"] = self.script.n
                for _ in range(2 if self.script.duplicate_needs else 1):
                    self.reply(need)
                return
        self.reply({"id": fl.staging_id, "st": "staged"})
        self._later(self._switch())

    def _chunk(self, doc: dict[str, Any], data: bytes) -> None:
        fl = self.flash
        if fl.manifest is None or doc["id"] != fl.staging_id:
            return
        f, o = doc["f"], doc["o"]
        self.chunks[(f, o)] = self.chunks.get((f, o), 0) + 1
        if self.script.n is not None and len(data) > self.script.n:
            self.oversized += 1  # a real board would have run out of heap
            return
        if self.script.deaf_chunks > 0:
            self.script.deaf_chunks -= 1
            return
        if (f, o) in self.script.corrupt:  # a byte flipped on the way
            self.script.corrupt.discard((f, o))
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        if hashlib.sha256(data).hexdigest() != doc["h"]:
            self.reply({"id": fl.staging_id, "st": "bad", "f": f, "o": o})
            return
        if f < len(fl.files) and o == len(fl.files[f]):
            fl.files[f] += data
        if self.script.chunk_delay_s:
            self._later(self._need_later())
        else:
            self._need_next()

    async def _need_later(self) -> None:
        await asyncio.sleep(self.script.chunk_delay_s)
        self._need_next()

    async def _switch(self) -> None:
        fl = self.flash
        assert fl.manifest is not None
        uid, version = fl.staging_id, fl.manifest["v"]
        for (path, _, digest), blob in zip(fl.manifest["files"], fl.files, strict=True):
            assert hashlib.sha256(blob).hexdigest() == digest, path
        await asyncio.sleep(self.script.switch_delay_s)  # the reboot
        self.reply({"id": uid, "st": "trial", "v": version})
        await asyncio.sleep(self.script.switch_delay_s)
        if self.script.rollback_why is not None:
            self.reply({"id": uid, "st": "rolled_back", "v": fl.version, "why": self.script.rollback_why})
        else:
            fl.installed = {p: bytes(b) for (p, _, _), b in zip(fl.manifest["files"], fl.files, strict=True)}
            fl.version = version
            if not self.script.lose_verdict:
                self.reply({"id": uid, "st": "done", "v": version})
        fl.staging_id, fl.manifest, fl.files = None, None, []

    def _later(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
