"""The OTA wire format, artifacts and requests, without a broker."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from iggy_edge.ota import protocol as wire
from iggy_edge.ota import requests as req
from iggy_edge.ota.artifact import Artifact, ArtifactError, from_bundle
from iggy_edge.ota.cloud import cloud_messages

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"st":"reboot"}', "unknown state"),
        (b'{"st":"need","f":0}', "without a valid f and o"),
        (b'{"st":"need","f":true,"o":0}', "without a valid f and o"),
        (b'{"st":"bad","f":-1,"o":0}', "without a valid f and o"),
        (b'{"st":"done","id":"' + b"x" * 40 + b'"}', "bad update id"),
        (b'{"st":"done","id":"a b"}', "bad update id"),
        (b'{"st":"done","v":7}', "bad version"),
        (b'{"st":"done","v":"\\u0000"}', "bad version"),
        (b'{"st":"idle","pad":"' + b"x" * 1100 + b'"}', "over 1024"),
    ],
)
def test_garbage_replies_are_recognised_not_raised(payload: bytes, why: str) -> None:
    got = wire.parse_reply(payload)
    assert isinstance(got, wire.Garbage)
    assert why in got.reason


def test_good_replies_are_read_and_the_reason_is_bounded() -> None:
    assert wire.parse_reply(b'{"id":"u1","st":"need","f":2,"o":1024}') == wire.Reply("need", "u1", 2, 1024)
    got = wire.parse_reply(
        json.dumps({"id": "u1", "st": "rolled_back", "v": "v0", "why": "E\n" * 200}).encode()
    )
    assert isinstance(got, wire.Reply)
    assert len(got.why) == wire.MAX_WHY_CHARS
    assert got.why.isprintable()
    assert wire.parse_reply(b'{"st":"idle","v":"v0","mpy":6}') == wire.Reply("idle", v="v0", mpy=6)


def test_a_chunk_fits_the_board_and_a_full_manifest_its_payload_limit() -> None:
    msg = wire.chunk("u" + "0" * 12, 31, 250_000, b"\xff" * wire.CHUNK_BYTES)
    assert len(msg) <= 1536
    files = [(f"lib/iggy_device/module_number_{i:02d}.mpy", 99_999, "f" * 64) for i in range(wire.MAX_FILES)]
    assert len(wire.manifest("u" + "0" * 12, "x" * 32, files, 6)) < 4096  # the board's max_payload


@pytest.mark.parametrize(
    "path", ["/main.py", "../x.py", "a//b.py", "a/./b.py", "Main.py", "a b.py", "x" * 65, ""]
)
def test_file_paths_stay_inside_the_slot(path: str) -> None:
    assert wire.path_problem(path) is not None
    with pytest.raises(ArtifactError):
        Artifact("v1", ((path, b"x"),), None).check()


def test_a_bundle_is_checked_file_by_file() -> None:
    art = Artifact("v1", (("main.py", b"import app\n"), ("app.mpy", b"M\x06\x00\x1f" + b"x" * 3000)), 6, "t")
    assert from_bundle(art.bundle()) == art
    bundle = bytearray(art.bundle())
    bundle[-1] ^= 1
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        from_bundle(bytes(bundle))
    with pytest.raises(ArtifactError, match="after the last file"):
        from_bundle(art.bundle() + b"x")
    with pytest.raises(ArtifactError):
        from_bundle(b"not a bundle")
    with pytest.raises(ArtifactError, match="over the bound"):
        Artifact("v1", (("main.py", b"x" * 300_000),), None).check()
    for m in cloud_messages(art, ["dev-1"]):
        json.loads(m.partition(b"\n")[0])


def test_one_active_update_per_board_all_or_nothing(tmp_path: Path) -> None:
    conn = req.connect(tmp_path / "ota.db")
    art = Artifact("v1", (("main.py", b"x"),), None)
    req.put_artifact(conn, art)
    req.request(conn, art.id, [["dev-1"]])
    with pytest.raises(req.BoardBusy, match="dev-1"):
        req.request(conn, art.id, [["dev-2", "dev-1"]])
    assert {r["device"] for r in req.rows(conn)} == {"dev-1"}  # dev-2 was not queued either
    with pytest.raises(sqlite3.IntegrityError):  # the database holds it too
        conn.execute(
            "INSERT INTO ota_updates (id, device, artifact, rollout, wave, state, created_at, updated_at)"
            " VALUES ('u2', 'dev-1', ?, 'r', 0, 'queued', 0, 0)",
            (art.id,),
        )
    assert req.cancel(conn, ["dev-1"]) == 1
    req.request(conn, art.id, [["dev-1"]])  # finished: a new one may start
