"""Board updates through the real agent and a real Mosquitto, against the
scripted board (tests/support/ota_board.py, the contract's stand-in until
the device library's side is merged)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import read_dead_letters
from iggy_edge.config import Settings
from iggy_edge.downlink.commands import return_topic
from iggy_edge.inbox_admin import read_offsets
from iggy_edge.ota.cloud import INVALID_OTA, cloud_headers, cloud_messages, send_update
from iggy_edge.ota.component import updates_with
from iggy_edge.ota.updater import Limits
from iggy_edge.runtime import Agent, return_path
from iggy_edge.uplink.factory import make_command_source, make_uplink
from iggy_edge.uplink.iggy import IggyCommandSink
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.broker import Broker
from tests.support.downlink import downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.ota_agent import (
    FAST,
    RunningAgent,
    app,
    ota_settings,
    request,
    rows,
    running,
    state_of,
    stored_headers,
    wait_state,
)
from tests.support.ota_board import Script, ScriptedBoard
from tests.support.provisioning import gateway_settings, provision
from tests.support.return_path import device
from tests.support.return_path import provision as provision_memory
from tests.support.wait import async_wait_until


async def test_an_update_completes_and_the_board_reports_the_new_version(
    tmp_path: Path, broker: Broker
) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1")
    iggy = MemoryIggy()
    async with running(settings, iggy) as r:
        board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
        try:
            await request(settings, art, [["dev-1"]])
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()
        assert board.flash.version == "v1"
        assert board.flash.installed == dict(art.files)
        row = rows(settings)["dev-1"]
        assert row["board_version"] == "v1"
        assert row["done_bytes"] == art.total
        assert r.metric("iggy_edge_ota_updates_total", outcome="done") == 1
        # window 1: every chunk was asked for, and sent once
        assert all(n == 1 for n in board.chunks.values())
        needs = [x for x in board.replies if x["st"] == "need"]
        assert len(board.chunks) == len(needs)
        # up/ota is not telemetry; the board's status is
        await async_wait_until(
            lambda: any(h.endswith("/status") for h in stored_headers(iggy)), what="status stored"
        )
        assert not any(h.endswith("/up/ota") for h in stored_headers(iggy))


async def test_a_lost_chunk_is_sent_again_after_the_timeout_and_nothing_runs_ahead(
    tmp_path: Path, broker: Broker
) -> None:
    settings = ota_settings(tmp_path, broker)
    async with running(settings) as r:
        board = await ScriptedBoard(broker.host, broker.port, "dev-1", script=Script(deaf_chunks=2)).start()
        try:
            await request(settings, app("v1"), [["dev-1"]])
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()
        chunks = [(m["f"], m["o"]) for m in board.received if m["t"] == "c"]
        assert chunks[:3] == [(0, 0), (0, 0), (0, 0)]  # window 1: the same chunk until it is answered
        assert r.metric("iggy_edge_ota_resends_total", why="timeout") >= 2


async def test_a_corrupted_chunk_is_fetched_again(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1")
    async with running(settings) as r:
        board = await ScriptedBoard(
            broker.host, broker.port, "dev-1", script=Script(corrupt={(1, 1024)})
        ).start()
        try:
            await request(settings, art, [["dev-1"]])
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()
        assert board.chunks[(1, 1024)] == 2
        assert {"id": rows(settings)["dev-1"]["id"], "st": "bad", "f": 1, "o": 1024} in board.replies
        assert board.flash.installed == dict(art.files)
        assert r.metric("iggy_edge_ota_resends_total", why="bad_chunk") == 1


async def test_a_board_that_reconnects_mid_download_resumes_where_it_stopped(
    tmp_path: Path, broker: Broker
) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1", size=8000)
    # a long resend timeout: only the reconnect can bring the manifest again in time
    limits = Limits(resend_s=30.0, resend_max_s=30.0, tick_s=0.05)
    async with running(settings, limits=limits):
        board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
        await request(settings, art, [["dev-1"]])
        await async_wait_until(lambda: len(board.chunks) >= 4, what="some chunks")
        script = board.script
        script.silent = True  # the connection drops here
        await board.stop()
        script.silent = False
        held = {i: bytes(b) for i, b in enumerate(board.flash.files)}
        again = ScriptedBoard(broker.host, broker.port, "dev-1", script=script)
        again.flash = board.flash  # the same flash
        await again.start()
        try:
            await wait_state(settings, "dev-1", "done", timeout=15)
        finally:
            await again.stop()
        assert again.manifests >= 1
        first_need = next(x for x in again.replies if x["st"] == "need")
        assert (first_need["f"], first_need["o"]) != (0, 0)
        assert sum(map(len, held.values())) > 0
        assert (0, 0) not in again.chunks  # not from the start
        assert board.flash.installed == dict(art.files)


async def test_an_agent_restart_resumes_the_update(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1", size=8000)
    iggy = MemoryIggy()
    board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
    try:
        async with running(settings, iggy) as r:
            await request(settings, art, [["dev-1"]])
            await async_wait_until(lambda: len(board.chunks) >= 3, what="some chunks")
            board.script.silent = True  # what is in flight when the agent dies goes unanswered
            await r.hard_kill()
        seen = dict(board.chunks)
        board.script.silent = False
        assert state_of(settings, "dev-1") in ("offered", "downloading")
        async with running(settings, iggy):
            await wait_state(settings, "dev-1", "done")
        assert board.flash.installed == dict(art.files)
        assert all(n == 1 for k, n in board.chunks.items() if k in seen and k != max(seen))
    finally:
        await board.stop()


async def test_a_rollout_whose_canary_fails_stops_before_the_rest(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    names = [f"dev-{i}" for i in range(5)]
    boards = [
        await ScriptedBoard(
            broker.host,
            broker.port,
            n,
            script=Script(rollback_why="ImportError: no module named 'bme'") if i == 0 else None,
        ).start()
        for i, n in enumerate(names)
    ]
    try:
        async with running(settings) as r:
            done = await request(settings, app("v1"), [names[:1], names[1:]], max_failures=0)
            await wait_state(settings, "dev-0", "rolled_back")
            for n in names[1:]:
                await wait_state(settings, n, "cancelled")
            await asyncio.sleep(0.5)
            got = rows(settings)
            assert "ImportError" in got["dev-0"]["reason"]
            assert got["dev-0"]["board_version"] == "v0"
            assert all("stopped" in got[n]["reason"] for n in names[1:])
            assert all(b.received == [] for b in boards[1:])  # the rest never heard of it
            assert r.metric("iggy_edge_ota_updates_total", outcome="rolled_back") == 1
            assert done.rollout
    finally:
        for b in boards:
            await b.stop()


async def test_a_rollout_whose_canary_succeeds_goes_on(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    names = [f"dev-{i}" for i in range(3)]
    boards = [await ScriptedBoard(broker.host, broker.port, n).start() for n in names]
    try:
        async with running(settings):
            await request(settings, app("v1"), [names[:1], names[1:]])
            for n in names:
                await wait_state(settings, n, "done")
        first_rest = min(b.received and 1 for b in boards[1:])
        assert first_rest
        assert all(b.flash.version == "v1" for b in boards)
    finally:
        for b in boards:
            await b.stop()


async def test_garbage_on_up_ota_is_counted_and_ignored(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    iggy = MemoryIggy()
    garbage = [
        b"",
        b"\xff\xfe not json",
        b"[1,2,3]",
        b'{"st":"need","f":"zero","o":0}',
        b'{"st":"need","f":-1,"o":0}',
        b'{"st":"reboot"}',
        b'{"st":"done","id":"' + b"x" * 100 + b'"}',
        b'{"st":"idle","v":' + b"1" * 1100 + b"}",
    ]
    async with running(settings, iggy) as r:
        board = await ScriptedBoard(broker.host, broker.port, "dev-1", script=Script(deaf_chunks=1)).start()
        try:
            for g in garbage:
                board.publish_raw(g)
            await request(settings, app("v1"), [["dev-1"]])
            await async_wait_until(lambda: len(board.chunks) >= 1, what="a chunk")
            for g in garbage:  # mid-download too
                board.publish_raw(g)
            board.reply({"id": "someone-else", "st": "done", "v": "evil"})  # another update's: stale
            board.reply(
                {"id": rows(settings)["dev-1"]["id"], "st": "need", "f": 9, "o": 0}
            )  # outside the files
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()
        assert r.metric("iggy_edge_ota_replies_total", kind="garbage") >= 2 * (len(garbage) - 1) + 1
        assert r.metric("iggy_edge_ota_replies_total", kind="stale") >= 1
        assert rows(settings)["dev-1"]["board_version"] == "v1"
        assert not any(h.endswith("/up/ota") for h in stored_headers(iggy))


async def test_at_most_max_concurrent_updates_run_at_once(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    names = ["dev-a", "dev-b", "dev-c"]
    limits = Limits(max_concurrent=2, resend_s=0.4, resend_max_s=1.0, tick_s=0.05)
    boards = {
        n: await ScriptedBoard(broker.host, broker.port, n, script=Script(switch_delay_s=0.5)).start()
        for n in names
    }
    try:
        async with running(settings, limits=limits) as r:
            for n in names:
                await request(settings, app("v1"), [[n]])
            await async_wait_until(
                lambda: sum(1 for b in boards.values() if b.received) == 2, what="two started"
            )
            await asyncio.sleep(0.3)
            waiting = [n for n, b in boards.items() if not b.received]
            assert len(waiting) == 1
            assert state_of(settings, waiting[0]) == "queued"
            assert r.metric("iggy_edge_ota_bound_hits_total", bound="concurrent") == 1
            for n in names:
                await wait_state(settings, n, "done")
    finally:
        for b in boards.values():
            await b.stop()


async def test_bounds_end_an_update_failed_with_the_reason(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    limits = Limits(resend_s=0.2, resend_max_s=0.3, stall_s=1.5, max_bad_chunks=3, tick_s=0.05)
    corrupt_all = Script(corrupt={(1, o) for o in range(0, 5000, 1024)} | {(0, 0)})
    corrupt_all.corrupt = CorruptAlways()
    async with running(settings, limits=limits):
        bad = await ScriptedBoard(broker.host, broker.port, "dev-bad", script=corrupt_all).start()
        mute = await ScriptedBoard(broker.host, broker.port, "dev-mute", script=Script(silent=True)).start()
        big = await ScriptedBoard(broker.host, broker.port, "dev-big", script=Script(max_total=1000)).start()
        old = await ScriptedBoard(broker.host, broker.port, "dev-old", script=Script(mpy=5)).start()
        try:
            for n in ("dev-bad", "dev-mute", "dev-big"):
                await request(settings, app("v1"), [[n]])
            await request(settings, app("v1", mpy=6), [["dev-old"]])
            for n in ("dev-bad", "dev-mute", "dev-big", "dev-old"):
                await wait_state(settings, n, "failed")
        finally:
            for b in (bad, mute, big, old):
                await b.stop()
        got = rows(settings)
        assert "corrupted" in got["dev-bad"]["reason"]
        assert "no answer" in got["dev-mute"]["reason"]
        assert "too big" in got["dev-big"]["reason"]
        assert ".mpy version 5" in got["dev-old"]["reason"]
        assert old.manifests == 0


class CorruptAlways(set[tuple[int, int]]):
    """Every chunk arrives with a flipped byte."""

    def __contains__(self, item: object) -> bool:
        return True

    def discard(self, item: object) -> None:
        pass


_ = FAST


def publish_ota(iggy: MemoryIggy, settings: Settings, payloads: list[bytes]) -> None:
    """What the cloud side writes (`send_update`): the gateway's return-path topic, kind = ota."""
    rt = return_topic(settings)
    for m in payloads:
        iggy.publish(rt.stream, rt.topic, rt.partition, m, cloud_headers())


async def test_an_update_requested_by_the_cloud_side_through_the_return_topic(
    tmp_path: Path, broker: Broker
) -> None:
    """Chunks and request ride the one return-path topic with kind = ota, read
    by the return poll; garbage, a tampered chunk and a request for an unknown
    artifact are dead letters with their reasons, and the poll goes on."""
    settings = ota_settings(tmp_path, broker)
    iggy = MemoryIggy()
    provision_memory(iggy, settings)
    art = app("v2", size=150_000)  # three Iggy chunks
    good = cloud_messages(art, ["dev-1"])
    tampered = bytearray(good[1])
    tampered[-1] ^= 1
    nope = b'{"t":"update","artifact":"nope","devices":["dev-1"]}'
    publish_ota(iggy, settings, [b"garbage", bytes(tampered), nope])
    async with running(settings, iggy, with_return_path=True) as r:
        board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
        try:
            await async_wait_until(
                lambda: len(read_dead_letters(settings.buffer_path)) == 3, what="3 refused"
            )
            assert state_of(settings, "dev-1") is None  # nothing usable yet
            publish_ota(iggy, settings, good)
            await wait_state(settings, "dev-1", "done", timeout=30)
        finally:
            await board.stop()
        assert board.flash.installed == dict(art.files)
        assert r.metric("iggy_edge_ota_bound_hits_total", bound="artifact") == 3
    dead = sorted(read_dead_letters(settings.buffer_path), key=lambda d: d.id)
    assert [d.reason for d in dead] == [INVALID_OTA] * 3
    assert "not an ota message" in dead[0].detail
    assert "sha256 mismatch" in dead[1].detail
    assert "no artifact nope" in dead[2].detail
    assert bytes(dead[1].payload) == bytes(tampered)
    assert not [t for t in iggy.topics if t[1].startswith("ota.")]  # no topic of its own any more


async def test_cloud_chunks_are_durable_before_the_offset_and_a_re_read_takes_nothing_twice(
    tmp_path: Path, broker: Broker
) -> None:
    """Two chunks, then the agent is killed; the chunks are in ota.db (the
    poll's offset past them), the rest comes after the restart.  Then the
    return poll reads the whole topic again (its offsets forgotten): neither a
    second rollout nor a dead letter."""
    settings = ota_settings(tmp_path, broker)
    iggy = MemoryIggy()
    provision_memory(iggy, settings)
    art = app("v3", size=150_000)
    good = cloud_messages(art, ["dev-1"])
    publish_ota(iggy, settings, good[:2])
    first = await RunningAgent(settings, iggy, FAST, with_return_path=True).start()
    try:
        await async_wait_until(lambda: consumed(settings) == 1, what="two chunks consumed")
        assert held_chunks(settings) == 2  # durable before the offset moved past them
    finally:
        await first.hard_kill()
    publish_ota(iggy, settings, good[2:])
    async with running(settings, iggy, with_return_path=True):
        board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
        try:
            await wait_state(settings, "dev-1", "done", timeout=30)
        finally:
            await board.stop()
    assert held_chunks(settings) == 0
    conn = sqlite3.connect(settings.buffer_path)
    conn.execute("DELETE FROM downlink_offsets")  # the poll reads everything again
    conn.commit()
    conn.close()
    async with running(settings, iggy, with_return_path=True):
        await async_wait_until(lambda: consumed(settings) == len(good) - 1, what="read again")
    assert len(rows_all(settings)) == 1
    assert read_dead_letters(settings.buffer_path) == []


def consumed(settings: Settings) -> int:
    rt = return_topic(settings)
    got = [o[3] for o in read_offsets(settings.buffer_path) if (o[0], o[1]) == (rt.stream, rt.topic)]
    return got[0] if got else -1


def held_chunks(settings: Settings) -> int:
    conn = sqlite3.connect(settings.state_dir / "ota.db")
    try:
        return int(conn.execute("SELECT COUNT(*) FROM ota_cloud_chunks").fetchone()[0])
    finally:
        conn.close()


def rows_all(settings: Settings) -> list[object]:
    """Every update row in ota.db (none while the agent is still making it)."""
    path = settings.state_dir / "ota.db"
    if not path.exists():
        return []
    conn = sqlite3.connect(path)
    try:
        return list(conn.execute("SELECT id FROM ota_updates").fetchall())
    except sqlite3.OperationalError:  # the file is there, its tables not yet
        return []
    finally:
        conn.close()


@pytest.mark.iggy
async def test_a_cloud_update_reaches_a_board_through_the_least_privileged_gateway_user(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """`cloud provision-gateway` (admin) makes the topic and the gateway's
    user; the cloud side's `send_update` writes the update to return.<gw>;
    the agent, logged in as the gateway's user, applies it to the board."""
    iggy = {"kind": "iggy", "address": iggy_server.address, "username": iggy_server.username}
    admin = downlink_settings(tmp_path, broker, iggy={**iggy, "password": iggy_server.password})
    provisioned = await provision(admin)
    art = app("v4", size=70_000)  # two chunks
    sink = IggyCommandSink(admin.iggy)
    try:
        offsets = await send_update(sink, admin.gateway_id, admin.downlink, art, ["dev-1"])
    finally:
        await sink.close()
    assert offsets == [0, 1, 2]
    settings = gateway_settings(admin, provisioned)
    agent = Agent(
        settings,
        uplink=make_uplink(settings),
        command_source=make_command_source(settings),
        components=(updates_with(FAST), return_path),
    )
    task = asyncio.create_task(agent.run())
    board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        await async_wait_until(lambda: len(rows_all(settings)) == 1, timeout=30, what="the rollout queued")
        await wait_state(settings, "dev-1", "done", timeout=40)
        assert agent.metrics.value("iggy_edge_downlink_errors_total", kind="poll") == 0
    finally:
        await board.stop()
        agent.stop()
        await asyncio.wait_for(task, 20)
    assert board.flash.installed == dict(art.files)
    assert read_dead_letters(settings.buffer_path) == []


async def test_a_lost_verdict_is_asked_for_after_the_switch(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    async with running(settings):
        board = await ScriptedBoard(
            broker.host, broker.port, "dev-1", script=Script(lose_verdict=True)
        ).start()
        try:
            await request(settings, app("v1"), [["dev-1"]])
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()
        kinds = [m["t"] for m in board.received]
        assert kinds[-1] == "q"  # after the switch it asked, and took "idle v1" as done
        assert kinds.count("q") >= 2  # the first probe, and that one
        assert rows(settings)["dev-1"]["board_version"] == "v1"


async def test_progress_is_committed_while_downloading(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1", size=12_000)
    async with running(settings):
        board = await ScriptedBoard(
            broker.host, broker.port, "dev-1", script=Script(chunk_delay_s=0.25)
        ).start()
        try:
            await request(settings, art, [["dev-1"]])
            await async_wait_until(
                lambda: 0 < (rows(settings)["dev-1"]["done_bytes"] or 0) < art.total,
                what="progress mid-download",
            )
            assert state_of(settings, "dev-1") == "downloading"
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()


async def test_chunks_follow_the_size_the_board_asks_for_and_a_repeated_need_is_answered_once(
    tmp_path: Path, broker: Broker
) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1", size=5000)
    limits = Limits(resend_s=5.0, resend_max_s=5.0, tick_s=0.05)  # no timeout resends in this test
    async with running(settings, limits=limits) as r:
        board = await ScriptedBoard(
            broker.host, broker.port, "dev-1", script=Script(n=512, duplicate_needs=True)
        ).start()
        try:
            await request(settings, art, [["dev-1"]])
            await wait_state(settings, "dev-1", "done")
        finally:
            await board.stop()
        assert board.oversized == 0
        assert (1, 512) in board.chunks
        assert (1, 1024) in board.chunks  # 512 at a time
        assert all(n == 1 for n in board.chunks.values())  # each asked twice, sent once
        assert r.metric("iggy_edge_ota_replies_total", kind="duplicate") >= len(board.chunks) - 1
        assert board.flash.installed == dict(art.files)


async def test_nothing_goes_to_a_board_while_its_status_is_offline(tmp_path: Path, broker: Broker) -> None:
    settings = ota_settings(tmp_path, broker)
    art = app("v1", size=8000)
    async with running(settings), device(broker, "edge/dev-1/down/ota") as watch:
        board = await ScriptedBoard(broker.host, broker.port, "dev-1").start()
        await request(settings, art, [["dev-1"]])
        await async_wait_until(lambda: len(board.chunks) >= 3, what="some chunks")
        board.script.silent = True
        await board.stop()  # status offline, then gone
        await asyncio.sleep(0.5)
        sent = len(watch.messages)
        await asyncio.sleep(4 * FAST.resend_max_s)  # several resend timeouts
        assert len(watch.messages) == sent  # held while offline
        board.script.silent = False
        again = ScriptedBoard(broker.host, broker.port, "dev-1", script=board.script)
        again.flash = board.flash
        await again.start()  # online: the manifest goes again
        try:
            await wait_state(settings, "dev-1", "done")
        finally:
            await again.stop()
        assert board.flash.installed == dict(art.files)
