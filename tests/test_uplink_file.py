from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from iggy_edge.records import OutboundRecord, make_message_id
from iggy_edge.uplink.file import FileUplink, decode_payload, read_records
from iggy_edge.uplink.partition import partition_for
from iggy_edge.uplink.protocol import Uplink, UplinkUnavailable

pytestmark = pytest.mark.unit


def rec(seq: int, key: str, payload: bytes | None = None) -> OutboundRecord:
    return OutboundRecord(
        seq=seq,
        message_id=make_message_id(0xFFFFFFFF, 0xFFFFFFFF, seq),
        stream="edge",
        topic="telemetry",
        key=key,
        payload=payload if payload is not None else f"p{seq}".encode(),
        headers={"mqtt-topic": f"edge/{key}/up/t"},
    )


async def test_lines_carry_everything_and_big_ids_survive(tmp_path: Path) -> None:
    path = tmp_path / "out" / "uplink.jsonl"
    up: Uplink = FileUplink(path, partitions=3)
    await up.start()
    batch = [rec(1, "a"), rec(2, "b", b"\xff\x00binary"), rec(3, "a")]
    await up.send(batch)
    await up.close()
    lines = read_records(path)
    # Grouped by partition, groups in order of first appearance.
    same = partition_for("a", 3) == partition_for("b", 3)
    assert [line["seq"] for line in lines] == ([1, 2, 3] if same else [1, 3, 2])
    by_seq = {line["seq"]: line for line in lines}
    for r in batch:
        line = by_seq[r.seq]
        assert int(line["message_id"]) == r.message_id  # 128-bit, exact
        assert line["partition"] == partition_for(r.key, 3)
        assert line["headers"] == r.headers
        assert decode_payload(line) == r.payload
    assert by_seq[2]["payload_encoding"] == "base64"
    assert by_seq[1]["payload_encoding"] == "utf8"
    # Per key order kept.
    a_seqs = [line["seq"] for line in lines if line["key"] == "a"]
    assert a_seqs == [1, 3]


async def test_down_marker_raises_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "uplink.jsonl"
    up = FileUplink(path)
    down = Path(str(path) + ".down")
    down.touch()
    with pytest.raises(UplinkUnavailable, match="down"):
        await up.send([rec(1, "a")])
    with pytest.raises(UplinkUnavailable):
        await up.start()
    assert read_records(path) == []
    down.unlink()
    await up.send([rec(1, "a")])
    await up.close()
    assert len(read_records(path)) == 1


async def test_torn_last_line_is_cut_before_appending(tmp_path: Path) -> None:
    path = tmp_path / "uplink.jsonl"
    up = FileUplink(path)
    await up.send([rec(1, "a")])
    await up.close()
    with path.open("ab") as f:
        f.write(b'{"seq": 2, "message_id": "12')  # a crash mid-write
    assert [line["seq"] for line in read_records(path)] == [1]
    up2 = FileUplink(path)
    await up2.send([rec(3, "a")])
    await up2.close()
    assert [line["seq"] for line in read_records(path)] == [1, 3]
    assert path.read_bytes().count(b"\n") == 2


async def test_file_of_only_a_torn_line_is_emptied(tmp_path: Path) -> None:
    path = tmp_path / "uplink.jsonl"
    path.write_bytes(b'{"seq": 1, "mess')
    up = FileUplink(path)
    await up.send([rec(2, "a")])
    await up.close()
    assert [line["seq"] for line in read_records(path)] == [2]


def test_confirmed_lines_survive_sigkill(tmp_path: Path) -> None:
    """A child process sends, prints 'sent', and is SIGKILLed: every record
    whose send returned is in the file."""
    path = tmp_path / "uplink.jsonl"
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        from iggy_edge.records import OutboundRecord
        from iggy_edge.uplink.file import FileUplink

        async def main():
            up = FileUplink({str(path)!r})
            for i in range(1, 51):
                r = OutboundRecord(i, i, "edge", "telemetry", "k", b"x" * 100, {{}})
                await up.send([r])
                print(i, flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "agent"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None
    last = 0
    for line in proc.stdout:
        last = int(line)
        if last == 50:
            break
    proc.kill()
    proc.wait()
    proc.stdout.close()
    seqs = [line["seq"] for line in read_records(path)]
    assert seqs == list(range(1, last + 1))
