"""Least-privilege provisioning from the cloud side (issue 23), against a real
iggy-server: `iggy-edge cloud provision-gateway` makes a gateway's return-path
topic and an Iggy user that can read only that topic (and store its offset)
and send only to the shared route topics; the agent then runs with that user
end to end and creates nothing."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tomllib
from pathlib import Path

import pytest
from iggy_edge.cloud.provision import gateway_username
from iggy_edge.config import Settings, load_config
from iggy_edge.downlink.commands import make_command, return_topic_of, stream_shard
from iggy_edge.runtime import build_agent
from iggy_edge.uplink.iggy import IggyCommandSink, IggyCommandSource, IggyUplink
from iggy_edge.uplink.iggy.connection import Connection
from iggy_edge.uplink.iggy.topics import create_topic, get_topic
from iggy_edge.uplink.protocol import UplinkError, UplinkRejected
from pydantic import SecretStr

from tests.support.agent import wait_subscribed
from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber, downlink_settings
from tests.support.iggy_server import IggyServer
from tests.support.mqtt import publish_all
from tests.support.provisioning import gateway_settings, provision
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.iggy

CLI = str(Path(sys.executable).parent / "iggy-edge")


def admin_settings(tmp_path: Path, server: IggyServer, broker: Broker | None = None) -> Settings:
    iggy = {
        "kind": "iggy",
        "address": server.address,
        "username": server.username,
        "password": server.password,
    }
    return downlink_settings(tmp_path, broker, iggy=iggy)


def neighbour(gateway: str, shards: int = 8) -> str:
    """Another gateway id whose topic is in the same stream as `gateway`'s."""
    want = stream_shard(gateway, shards)
    return next(g for g in (f"gw-n{i}" for i in range(1000)) if stream_shard(g, shards) == want)


async def refused(coro: object) -> str:
    try:
        await coro  # type: ignore[misc]
    except UplinkRejected as e:
        return str(e)
    raise AssertionError("the server did not refuse it")


async def test_a_gateway_credential_reads_only_its_own_topic_and_creates_nothing(
    tmp_path: Path, iggy_server: IggyServer
) -> None:
    admin = admin_settings(tmp_path, iggy_server)
    other = neighbour("gw-a")
    a = await provision(admin, "gw-a")
    b = await provision(admin, other)
    assert (a.created_topic, a.created_user) == (True, True)
    assert a.password is not None
    assert a.username == gateway_username("gw-a") == "gw-gw-a"
    ra, rb = return_topic_of("gw-a", admin.downlink), return_topic_of(other, admin.downlink)
    assert ra.stream == rb.stream  # same stream: permissions are per topic, not per stream
    assert a.send_topics == ["edge/acks", "edge/events", "edge/telemetry"]
    cmd = make_command("dev-1", "blink")
    admin_sink = IggyCommandSink(admin.iggy)
    for rt in (ra, rb):
        await admin_sink.publish(rt.stream, rt.topic, 0, cmd.wire(), cmd.headers())
    await admin_sink.close()

    gw = gateway_settings(admin, a).iggy
    source = IggyCommandSource(gw, "gw-a", "iggy-edge-gw-a")
    sink = IggyCommandSink(gw)
    conn = Connection(gw, "test")
    try:
        # its own topic: look, poll, store its consumer offset
        assert await source.last_offsets(ra.stream, ra.topic) == {0: 0}
        assert [m.headers["kind"] for m in await source.poll(ra.stream, ra.topic, 0, 0, 10)] == ["command"]
        await source.mirror_offset(ra.stream, ra.topic, 0, 0)
        assert await source.read_mirrored_offset(ra.stream, ra.topic, 0) == 0
        # another gateway's topic, in the same stream: neither read nor written
        assert "Unauthorized" in await refused(source.last_offsets(rb.stream, rb.topic))
        assert "Unauthorized" in await refused(source.poll(rb.stream, rb.topic, 0, 0, 10))
        assert "Unauthorized" in await refused(
            sink.publish(rb.stream, rb.topic, 0, cmd.wire(), cmd.headers())
        )
        # nor its own topic written (only the cloud side sends commands)
        assert "Unauthorized" in await refused(
            sink.publish(ra.stream, ra.topic, 0, cmd.wire(), cmd.headers())
        )
        # the fleet's telemetry: sent to, never read
        assert "Unauthorized" in await refused(source.poll("edge", "telemetry", 0, 0, 10))
        # nothing created: not a topic in its stream, not a stream
        client = await conn.client()
        assert "Unauthorized" in await refused(create_topic(conn, client, ra.stream, "mine", 1))
        assert "Unauthorized" in await refused(create_topic(conn, client, "edge-mine", "t", 1))
    finally:
        await source.close()
        await sink.close()
        await conn.close()
    assert b.password is not None


async def test_provisioning_again_keeps_the_password_and_rotate_replaces_it(
    tmp_path: Path, iggy_server: IggyServer
) -> None:
    admin = admin_settings(tmp_path, iggy_server)
    first = await provision(admin, "gw-r")
    again = await provision(admin, "gw-r")
    assert (again.created_topic, again.created_user, again.password) == (False, False, None)
    uplink = IggyUplink(gateway_settings(admin, first).iggy, "gw-r", topics=[("edge", "telemetry")])
    await uplink.start()  # the first password still works
    await uplink.close()
    rotated = await provision(admin, "gw-r", rotate=True)
    assert rotated.password not in (None, first.password)
    old = IggyUplink(gateway_settings(admin, first).iggy, "gw-r", topics=[("edge", "telemetry")])
    with pytest.raises(UplinkError, match=r"(?i)invalid credentials"):
        await old.start()
    await old.close()
    new = IggyUplink(gateway_settings(admin, rotated).iggy, "gw-r", topics=[("edge", "telemetry")])
    await new.start()
    await new.close()


async def held(reader: IggyCommandSource, topic: str, want: int) -> int:
    """Messages in edge/`topic` (3 partitions), once `want` are there or after 10 s."""
    got = 0
    for _ in range(100):
        got = 0
        for p in range(3):
            got += len(await reader.poll("edge", topic, p, 0, 100))
        if got >= want:
            break
        await asyncio.sleep(0.1)
    return got


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    full = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", **(env or {})}
    if "PYTHONPATH" in os.environ:  # a worktree's agent, not the installed one
        full["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = await asyncio.create_subprocess_exec(
        CLI, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=full
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def config_file(
    path: Path, gateway: str, state: Path, broker: Broker, server: IggyServer, extra: str
) -> Path:
    path.write_text(
        f'gateway_id = "{gateway}"\nstate_dir = "{state}"\n{extra}'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[iggy]\nkind = "iggy"\naddress = "{server.address}"\n'
        "[forward]\nlinger_ms = 5\n[downlink]\npoll_interval_s = 0.1\n[metrics]\nenabled = false\n"
    )
    return path


async def test_the_agent_runs_end_to_end_with_its_provisioned_credential(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """The cloud side provisions with the CLI (admin login), writing the
    gateway's credentials file; the agent, logged in as the gateway's user,
    forwards telemetry, gets a command and a config from `command send` /
    `config push --gateway` and sends the device's ack uplink."""
    admin_conf = config_file(
        tmp_path / "cloud.toml",
        "cloud",
        tmp_path / "cloud-state",
        broker,
        iggy_server,
        "",
    )
    admin_env = {"IGGY_USERNAME": iggy_server.username, "IGGY_PASSWORD": iggy_server.password}
    creds = tmp_path / "gw" / "credentials.toml"
    creds.parent.mkdir()
    creds.write_text('[mqtt]\nusername = "agent"\n')  # the gateway's broker login: kept
    code, out, err = await cli(
        "cloud",
        "provision-gateway",
        "-c",
        str(admin_conf),
        "--gateway",
        "gw-e2e",
        "--out",
        str(creds),
        "--json",
        env=admin_env,
    )
    assert code == 0, err
    shown = json.loads(out)
    assert "password" not in shown  # written to the file, not printed
    assert shown["credentials_file"] == str(creds)
    assert creds.stat().st_mode & 0o777 == 0o600
    written = tomllib.loads(creds.read_text())
    assert written["mqtt"] == {"username": "agent"}
    assert written["iggy"]["username"] == "gw-gw-e2e"
    creds.write_text(creds.read_text().replace('[mqtt]\nusername = "agent"\n\n', ""))  # no broker login here

    gw_conf = config_file(
        tmp_path / "gw" / "config.toml",
        "gw-e2e",
        tmp_path / "gw" / "state",
        broker,
        iggy_server,
        'credentials_file = "credentials.toml"\n',
    )
    settings = load_config(gw_conf, env={})
    assert settings.iggy.username == "gw-gw-e2e"
    assert settings.iggy.create_missing  # the default: it may try, it is never needed
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/dev-7/down/#").start()
    root = IggyCommandSource(load_config(admin_conf, env=admin_env).iggy, "cloud", "cloud-reader")
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        await wait_subscribed(agent)
        await publish_all(broker.host, broker.port, "dev-7", [("edge/dev-7/up/env", b'{"t": 21.5}')])

        assert await held(root, "telemetry", 1) == 1
        code, out, err = await cli(
            "command",
            "send",
            "-c",
            str(admin_conf),
            "--gateway",
            "gw-e2e",
            "-d",
            "dev-7",
            "--name",
            "relay",
            "--json",
            env=admin_env,
        )
        assert code == 0, err
        sent = json.loads(out)
        desired = tmp_path / "desired.json"
        desired.write_text('{"period_s": 5}')
        code, _, err = await cli(
            "config",
            "push",
            str(desired),
            "-c",
            str(admin_conf),
            "--gateway",
            "gw-e2e",
            "-d",
            "dev-7",
            env=admin_env,
        )
        assert code == 0, err
        await async_wait_until(lambda: len(dev.messages) == 2, timeout=30, what="command and config")
        assert {m.topic for m in dev.messages} == {"edge/dev-7/down/cmd", "edge/dev-7/down/config"}
        ack = json.dumps({"id": sent["id"], "status": "ok"}).encode()
        await publish_all(broker.host, broker.port, "dev-7", [("edge/dev-7/up/ack", ack)])

        assert await held(root, "acks", 1) == 1
        assert agent.metrics.value("iggy_edge_downlink_errors_total", kind="poll") == 0
    finally:
        await dev.stop()
        await root.close()
        agent.stop()
        await asyncio.wait_for(task, 20)


async def test_a_fleet_is_provisioned_in_one_run_each_gateway_with_its_own_token(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """`provision-gateway` with several gateways (-g and --gateways-file,
    a duplicate and a comment in it) writes one credentials file each to
    --out-dir; each file's token reads its own gateway's topic only."""
    admin_conf = config_file(tmp_path / "cloud.toml", "cloud", tmp_path / "cs", broker, iggy_server, "")
    admin_env = {"IGGY_USERNAME": iggy_server.username, "IGGY_PASSWORD": iggy_server.password}
    listed = tmp_path / "fleet.txt"
    listed.write_text("# site 4\ngw-f2\n\ngw-f3\ngw-f1\n")
    out_dir = tmp_path / "creds"
    code, out, err = await cli(
        "cloud", "provision-gateway", "-c", str(admin_conf), "-g", "gw-f1",
        "--gateways-file", str(listed), "--out-dir", str(out_dir), "--json", env=admin_env,
    )  # fmt: skip
    assert code == 0, err
    shown = [json.loads(line) for line in out.splitlines()]
    assert [s["gateway"] for s in shown] == ["gw-f1", "gw-f2", "gw-f3"]
    assert all("password" not in s and s["created_user"] for s in shown)
    files = {gw: out_dir / f"{gw}.toml" for gw in ("gw-f1", "gw-f2", "gw-f3")}
    assert [s["credentials_file"] for s in shown] == [str(f) for f in files.values()]
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files.values())

    admin = admin_settings(tmp_path, iggy_server)
    cmd = make_command("dev-1", "blink")
    topics = {gw: return_topic_of(gw, admin.downlink) for gw in files}
    admin_sink = IggyCommandSink(admin.iggy)
    for rt in topics.values():
        await admin_sink.publish(rt.stream, rt.topic, 0, cmd.wire(), cmd.headers())
    await admin_sink.close()
    for gw, path in files.items():
        written = tomllib.loads(path.read_text())["iggy"]
        assert set(written) == {"username", "token"}
        creds = {"username": written["username"], "token": SecretStr(written["token"])}
        source = IggyCommandSource(admin.iggy.model_copy(update=creds), gw, f"iggy-edge-{gw}")
        try:
            own = topics[gw]
            assert [m.headers["kind"] for m in await source.poll(own.stream, own.topic, 0, 0, 10)] == [
                "command"
            ]
            for other in (rt for g, rt in topics.items() if g != gw):
                assert "Unauthorized" in await refused(source.poll(other.stream, other.topic, 0, 0, 10))
        finally:
            await source.close()


async def test_a_bad_id_in_the_fleet_list_stops_the_run_before_anything_is_made(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    admin_conf = config_file(tmp_path / "cloud.toml", "cloud", tmp_path / "cs", broker, iggy_server, "")
    admin_env = {"IGGY_USERNAME": iggy_server.username, "IGGY_PASSWORD": iggy_server.password}
    listed = tmp_path / "fleet.txt"
    listed.write_text("gw-ok\ngw/bad\n")
    code, _, err = await cli(
        "cloud", "provision-gateway", "-c", str(admin_conf), "--gateways-file", str(listed),
        "--out-dir", str(tmp_path / "creds"), env=admin_env,
    )  # fmt: skip
    assert code == 2, err
    assert "gw/bad" in err
    admin = admin_settings(tmp_path, iggy_server)
    rt = return_topic_of("gw-ok", admin.downlink)
    conn = Connection(admin.iggy, "test")
    try:
        assert await get_topic(conn, await conn.client(), rt.stream, rt.topic) is None
    finally:
        await conn.close()
    code, _, err = await cli(
        "cloud", "provision-gateway", "-c", str(admin_conf), "-g", "gw-a", "-g", "gw-b",
        "--out", str(tmp_path / "one.toml"), env=admin_env,
    )  # fmt: skip
    assert code == 2, err
    assert "--out-dir" in err


def test_doctor_takes_a_provisioned_gateway_user_for_what_it_is(
    tmp_path: Path, iggy_server: IggyServer
) -> None:
    """The gateway's user may read neither users nor the send-only route
    topics: doctor says it is least-privileged and its topics are there,
    instead of failing on "cannot read streams/topics"; before provisioning
    it names the command to run."""
    from tests.test_ops_doctor import doctor  # noqa: PLC0415 - its runner, not a fixture

    admin = admin_settings(tmp_path, iggy_server)
    made = asyncio.run(provision(admin, "gw-doc"))
    assert made.password is not None
    config = tmp_path / "config.toml"
    config.write_text(
        f'gateway_id = "gw-doc"\nstate_dir = "{tmp_path / "state"}"\n[mqtt]\nhost = "127.0.0.1"\nport = 1\n'
        f'[iggy]\nkind = "iggy"\naddress = "{iggy_server.address}"\nusername = "{made.username}"\n'
    )
    _, checks, _ = doctor(config, env={"IGGY_PASSWORD": made.password})
    perms = checks["iggy permissions"]
    assert perms["status"] == "ok", perms
    assert "least-privileged" in perms["detail"]
    other = asyncio.run(provision(admin, "gw-doc", username="gw-other-user"))
    config.write_text(
        config.read_text()
        .replace('"gw-doc"\nstate', '"gw-new"\nstate')
        .replace(made.username, other.username)
    )
    _, checks, _ = doctor(config, env={"IGGY_PASSWORD": other.password or ""})
    perms = checks["iggy permissions"]
    assert perms["status"] == "fail", perms
    assert "return.gw-new" in perms["detail"]
    assert "iggy-edge cloud provision-gateway" in perms["fix"]
