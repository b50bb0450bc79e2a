"""An update's files, as the gateway keeps them: an `Artifact`.

Its id is the sha256 of its *bundle*: one JSON header line (version, .mpy
version, every file with size and sha256) then every file's bytes in order.
The bundle is also how the cloud side hands an artifact to the gateway
through Iggy (cloud.py), so one digest names the same bytes everywhere, and
`from_bundle` checks every file's sha256 and every bound before anything is
kept.  Bounded: at most `protocol.MAX_FILES` files, `MAX_ARTIFACT_BYTES`
of file bytes (the board also refuses a total over its free flash).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Final

from .protocol import MAX_FILES, path_problem, sha256_hex, version_problem

MAX_ARTIFACT_BYTES: Final = 256 * 1024  # the file bytes of one update (the contract's board bound)
MAX_HEADER_BYTES: Final = 8192


class ArtifactError(ValueError):
    """An artifact that cannot be used: the message says why."""


@dataclass(frozen=True)
class Artifact:
    version: str
    files: tuple[tuple[str, bytes], ...]  # (board path relative to the slot, bytes), in order
    mpy: int | None  # the .mpy version of its bytecode files, None without any
    source: str = ""  # what it was built from (shown in status)

    @cached_property
    def entries(self) -> list[tuple[str, int, str]]:
        """(path, size, sha256 hex) per file: the manifest's ``files``."""
        return [(p, len(d), sha256_hex(d)) for p, d in self.files]

    @property
    def total(self) -> int:
        return sum(len(d) for _, d in self.files)

    def header(self) -> bytes:
        doc = {"v": self.version, "mpy": self.mpy, "files": self.entries, "source": self.source[:200]}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode() + b"\n"

    def bundle(self) -> bytes:
        return self.header() + b"".join(d for _, d in self.files)

    @cached_property
    def id(self) -> str:
        return sha256_hex(self.bundle())

    def check(self, max_bytes: int = MAX_ARTIFACT_BYTES) -> None:
        """Raise ArtifactError unless every bound and name holds."""
        problem = version_problem(self.version)
        if problem:
            raise ArtifactError(problem)
        if not self.files:
            raise ArtifactError("an update needs at least one file")
        if len(self.files) > MAX_FILES:
            raise ArtifactError(f"{len(self.files)} files, at most {MAX_FILES} per update")
        paths = [p for p, _ in self.files]
        if len(set(paths)) != len(paths):
            raise ArtifactError("a file path appears twice")
        for p in paths:
            problem = path_problem(p)
            if problem:
                raise ArtifactError(problem)
        if self.total > max_bytes:
            raise ArtifactError(f"{self.total} bytes of files, over the bound of {max_bytes} bytes")
        if self.mpy is not None and (isinstance(self.mpy, bool) or not 0 <= self.mpy < 256):
            raise ArtifactError(f"bad .mpy version {self.mpy!r}")


def from_bundle(data: bytes, *, max_bytes: int = MAX_ARTIFACT_BYTES) -> Artifact:
    """The artifact in `data` (untrusted: the cloud side's bytes), every
    file checked against its sha256 and every bound; ArtifactError if not."""
    if len(data) > max_bytes + MAX_HEADER_BYTES:
        raise ArtifactError(f"bundle of {len(data)} bytes, over the bound")
    head, nl, body = data.partition(b"\n")
    if not nl or len(head) > MAX_HEADER_BYTES:
        raise ArtifactError("bundle without a header line")
    try:
        doc = json.loads(head)
        version, mpy, entries = doc["v"], doc.get("mpy"), doc["files"]
        files: list[tuple[str, bytes]] = []
        at = 0
        if not isinstance(entries, list) or len(entries) > MAX_FILES:
            raise ArtifactError("bad file list")
        for path, size, digest in entries:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or at + size > len(body):
                raise ArtifactError(f"file {path!r}: bad size")
            blob = body[at : at + size]
            at += size
            if sha256_hex(blob) != digest:
                raise ArtifactError(f"file {path!r}: sha256 mismatch")
            files.append((path, blob))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"bad bundle header: {type(e).__name__}") from None
    if at != len(body):
        raise ArtifactError(f"{len(body) - at} bytes after the last file")
    art = Artifact(str(version), tuple(files), mpy, str(doc.get("source", ""))[:200])
    art.check(max_bytes)
    return art
