"""`FileUplink`: an uplink that appends JSON lines to a file, fsynced.

A cross-process stand-in for Iggy used by crash tests (the agent is
SIGKILLed; the test reads the file afterwards) and for debugging.  One line
per record::

    {"seq": 7, "message_id": "792281...", "stream": "edge", "topic": "telemetry",
     "key": "dev-1", "partition": 2, "headers": {...},
     "payload": "text" | "<base64>", "payload_encoding": "utf8" | "base64"}

`message_id` is a decimal string because 128-bit integers do not survive
every JSON reader.  `send` returns only after the lines are written and
``fsync``ed, so a confirmed record is on disk.  A line torn by a crash is
never confirmed; it is cut off when the file is next opened for appending and
skipped by `read_records`.

Fault injection across processes: while a file ``<path>.down`` exists, every
call raises UplinkUnavailable.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from ..records import OutboundRecord
from .partition import KeyPartitioner, by_topic
from .protocol import UplinkAmbiguous, UplinkUnavailable


def encode_line(record: OutboundRecord, partition: int) -> bytes:
    try:
        payload, encoding = record.payload.decode(), "utf8"
    except UnicodeDecodeError:
        payload, encoding = base64.b64encode(record.payload).decode(), "base64"
    obj = {
        "seq": record.seq,
        "message_id": str(record.message_id),
        "stream": record.stream,
        "topic": record.topic,
        "key": record.key,
        "partition": partition,
        "headers": record.headers,
        "payload": payload,
        "payload_encoding": encoding,
    }
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode_payload(line: dict[str, Any]) -> bytes:
    text = str(line["payload"])
    if line.get("payload_encoding") == "base64":
        return base64.b64decode(text)
    return text.encode()


def read_records(path: Path) -> list[dict[str, Any]]:
    """All complete lines of a FileUplink file (a torn last line is skipped)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    complete, _, _torn = data.rpartition(b"\n")
    return [json.loads(line) for line in complete.split(b"\n") if line]


class FileUplink:
    def __init__(self, path: Path, *, partitions: int = 3) -> None:
        self.path = Path(path)
        self.partitions = partitions
        self.down_path = self.path.with_name(self.path.name + ".down")
        self._file: BinaryIO | None = None
        self._partitioner = KeyPartitioner()

    def _check_down(self) -> None:
        if self.down_path.exists():
            raise UplinkUnavailable(f"file uplink marked down ({self.down_path} exists)")

    def _open(self) -> BinaryIO:
        if self._file is not None:
            return self._file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+b")
        # Cut a line torn by a crash, so the next append starts a fresh line.
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(pos, 65536)
            f.seek(pos - step)
            chunk = f.read(step)
            if pos == end and chunk.endswith(b"\n"):
                break
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(pos - step + cut + 1)
                os.fsync(f.fileno())
                break
            pos -= step
        else:
            if end:
                f.truncate(0)
                os.fsync(f.fileno())
        self._file = f
        return f

    def _write(self, lines: list[bytes]) -> None:
        f = self._open()
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())

    async def start(self) -> None:
        self._check_down()
        await asyncio.to_thread(self._open)

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        self._check_down()
        if not batch:
            return
        lines: list[bytes] = []
        for (stream, topic), records in by_topic(batch).items():
            for p, group in self._partitioner.split(stream, topic, self.partitions, records):
                lines.extend(encode_line(r, p) for r in group)
        try:
            await asyncio.to_thread(self._write, lines)
        except OSError as e:
            # A failed write may have left part of the batch in the file.
            self._close_file()
            raise UplinkAmbiguous(f"file uplink: cannot write {self.path}: {e}") from e

    def _close_file(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    async def close(self) -> None:
        self._close_file()
