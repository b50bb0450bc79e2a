"""What one gateway costs the Iggy server, cut (issue 23): one connection
for the uplink and the return path, a heartbeat every 60 s, a token login,
a start-up jitter for the first connect, and lane connections that close
when idle.

The unit tests give the adapter a fake SDK client at the factory boundary
(the TcpConfig it receives is the real one); the ``iggy`` tests use a real
iggy-server.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from apache_iggy import TcpConfig
from iggy_edge.cloud.provision import provision_gateway
from iggy_edge.config import IggySettings, load_config, parse_config
from iggy_edge.downlink.commands import return_topic
from iggy_edge.records import OutboundRecord
from iggy_edge.uplink import factory
from iggy_edge.uplink.iggy import IggyUplink
from iggy_edge.uplink.iggy import connection as connection_module
from iggy_edge.uplink.iggy import send as send_module
from iggy_edge.uplink.iggy.connection import Connection, create_personal_access_token
from iggy_edge.uplink.protocol import UplinkUnavailable
from pydantic import SecretStr

from tests.support.iggy_server import IggyServer


class Fake:
    """The clients the adapter made, the configs they got and their calls."""

    def __init__(self) -> None:
        self.configs: list[TcpConfig] = []
        self.calls: list[tuple[int, str]] = []  # (client index, method)
        self.logged_out: list[int] = []

    def factory(self, config: TcpConfig) -> Any:
        self.configs.append(config)
        return _FakeClient(self, len(self.configs) - 1)


class _FakeClient:
    def __init__(self, fake: Fake, index: int) -> None:
        self.f, self.i = fake, index

    def _note(self, name: str) -> None:
        self.f.calls.append((self.i, name))

    async def connect(self) -> None:
        self._note("connect")

    async def login_user(self, username: str, password: str) -> None:
        self._note("login_user")

    async def logout_user(self) -> None:
        self._note("logout_user")
        self.f.logged_out.append(self.i)

    async def get_topic(self, stream: str, topic: str) -> SimpleNamespace:
        self._note("get_topic")
        return SimpleNamespace(partitions_count=3, partitions=[])

    async def send_messages(self, stream: str, topic: str, partition: int, messages: list[Any]) -> Any:
        self._note("send_messages")
        return SimpleNamespace(confirmations=[])


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fake:
    f = Fake()
    monkeypatch.setattr(connection_module, "IggyClient", f.factory)
    monkeypatch.setattr(send_module, "_to_send_message", lambda r: r)
    return f


def _settings(tmp_path: Path, downlink: dict[str, Any] | None = None, **iggy: Any) -> Any:
    base = {"kind": "iggy", "address": "127.0.0.1:8090", "password": "pw", **iggy}
    raw = {"gateway_id": "gw-1", "state_dir": str(tmp_path), "iggy": base, "downlink": downlink or {}}
    return parse_config(raw, env={})


def _rec(seq: int, key: str, topic: str = "telemetry") -> OutboundRecord:
    return OutboundRecord(seq, seq, "edge", topic, key, b"x", {})


@pytest.mark.unit
async def test_the_agent_uplink_and_return_path_share_one_connection(fake: Fake, tmp_path: Path) -> None:
    uplink, source = factory.make_uplink_and_source(_settings(tmp_path))
    assert uplink is not None
    assert source is not None
    await uplink.start()
    await source.start()
    await source.last_offsets("edge", "commands.gw-1")
    assert len(fake.configs) == 1, "the uplink and the return path logged in once between them"
    assert fake.configs[0].heartbeat_interval == timedelta(seconds=factory.POLLED_HEARTBEAT_S), (
        "the return poll's request a second is the heartbeat; the SDK's ping would only add to it"
    )
    await uplink.close()
    assert fake.logged_out == [], "the return path still uses the connection"
    await source.close()
    assert fake.logged_out == [0]


@pytest.mark.unit
async def test_heartbeat_every_30_s_and_a_token_login_instead_of_the_password(
    fake: Fake, tmp_path: Path
) -> None:
    up = IggyUplink(_settings(tmp_path).iggy, "gw-1")
    await up.start()
    assert fake.configs[0].heartbeat_interval == timedelta(seconds=60)
    assert fake.calls[:2] == [(0, "connect"), (0, "login_user")]
    assert "disabled" in repr(fake.configs[0].auto_login).lower()

    tok = IggyUplink(_settings(tmp_path, token="s3cr3t", heartbeat_interval_s=120).iggy, "gw-1")
    await tok.start()
    assert fake.configs[1].heartbeat_interval == timedelta(seconds=120)
    assert "personal_access_token" in repr(fake.configs[1].auto_login)
    assert (1, "login_user") not in fake.calls, "the token logs in on connect; no password login"


@pytest.mark.unit
async def test_the_sdk_pings_at_its_interval_where_no_poll_keeps_the_connection_busy(
    fake: Fake, tmp_path: Path
) -> None:
    for downlink, want in (
        ({"enabled": False}, 60.0),  # no return path: the idle connection pings a minute
        ({"poll_interval_s": 90.0}, 60.0),  # a poll rarer than the ping does not replace it
        ({}, factory.POLLED_HEARTBEAT_S),
    ):
        uplink, _ = factory.make_uplink_and_source(_settings(tmp_path, downlink))
        assert uplink is not None
        await uplink.start()
        assert fake.configs[-1].heartbeat_interval == timedelta(seconds=want), downlink
        await uplink.close()


@pytest.mark.unit
async def test_the_first_connect_waits_the_start_jitter_once(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr("random.uniform", lambda a, b: b * 0.5)
    monkeypatch.setattr("asyncio.sleep", sleep)  # only our code awaits in this test
    settings = _settings(tmp_path, start_jitter_s=20).iggy
    conn = Connection(settings, "gateway", start_jitter=settings.start_jitter_s)
    await conn.client()
    assert slept == [10.0]
    conn.drop()
    await conn.client()  # a reconnect: the caller's backoff is the jitter now
    assert slept == [10.0]
    await Connection(settings, "probe").client()  # one-shot users (CLI, probe) never wait
    assert slept == [10.0]


@pytest.mark.unit
async def test_callers_waiting_on_a_failing_connect_share_its_failure(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uplink and the return path share one connection: while the
    cluster turns logins away (a transient answer the SDK replays until our
    timeout), the second caller must not start a login of its own the
    moment the first gives up; both back off from the one failure."""

    async def busy(self: _FakeClient) -> None:
        self._note("connect")
        await asyncio.sleep(0.05)
        raise RuntimeError("Transiently not accepted")

    monkeypatch.setattr(_FakeClient, "connect", busy)
    conn = Connection(_settings(tmp_path, token="t").iggy, "gateway")
    results = await asyncio.gather(conn.client(), conn.client(), return_exceptions=True)
    assert all(isinstance(r, UplinkUnavailable) for r in results), results
    assert len(fake.configs) == 1, "one login attempt for both callers"
    with pytest.raises(UplinkUnavailable):
        await conn.client()  # a caller after the failure (its backoff spent) tries again
    assert len(fake.configs) == 2


@pytest.mark.unit
async def test_the_first_lane_uses_the_uplink_connection_and_idle_lanes_close(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(send_module, "LANE_IDLE_S", 0.2)
    up = IggyUplink(_settings(tmp_path).iggy, "gw-1")
    await up.start()
    lanes = await up.lanes([_rec(i, f"d{i}") for i in range(1, 10)])
    assert len(lanes) == 3
    await up.send_lane(*lanes[0])
    assert len(fake.configs) == 1, "one lane in use: no connection beyond the uplink's"
    await asyncio.gather(*(up.send_lane(lane, recs) for lane, recs in lanes))
    assert len(fake.configs) == 3, "three lanes side by side: two more connections"
    for _ in range(50):
        if sorted(fake.logged_out) == [1, 2]:
            break
        await asyncio.sleep(0.05)
    assert sorted(fake.logged_out) == [1, 2], "the idle lane connections were closed"
    await up.send_lane(*lanes[0])  # the uplink's own connection is still there
    assert len(fake.configs) == 3
    await up.close()


# -- against a real iggy-server -------------------------------------------------------------------


async def _create_token(server: IggyServer) -> str:
    """A personal access token of the root user."""
    admin = IggySettings(
        kind="iggy", address=server.address, username=server.username, password=SecretStr(server.password)
    )
    conn = Connection(admin, "token")
    try:
        return await create_personal_access_token(conn, "t1")
    finally:
        await conn.close()


@pytest.mark.iggy
async def test_a_token_login_and_one_shared_connection_on_a_real_server(
    iggy_server: IggyServer, tmp_path: Path
) -> None:
    token = await _create_token(iggy_server)
    settings = _settings(tmp_path, address=iggy_server.address, password=None, token=token)
    rt = return_topic(settings)
    root = _settings(tmp_path, address=iggy_server.address, password=iggy_server.password)
    admin = IggyUplink(root.iggy, "cloud", topics=[(rt.stream, rt.topic)])
    await admin.start()  # the return-path topic exists (provisioning's job)
    await admin.close()
    uplink, source = factory.make_uplink_and_source(settings)
    assert uplink is not None
    assert source is not None
    try:
        await uplink.start()
        # Both directions at once on the one SDK client: the SDK queues them.
        batch = [_rec(i, f"d{i % 7}") for i in range(1, 200)]
        polls = [source.poll(rt.stream, rt.topic, 0, 0, 10) for _ in range(3)]
        sends = [uplink.send(batch[i::4]) for i in range(4)]
        results = await asyncio.gather(*polls, *sends)
        assert results[:3] == [[], [], []]
        wrong = _settings(tmp_path, address=iggy_server.address, password=None, token="not-a-token")
        bad = IggyUplink(wrong.iggy, "gw-1")
        with pytest.raises(UplinkUnavailable, match=r"cannot connect/log in .* with a token"):
            await bad.start()
        await bad.close()
    finally:
        await uplink.close()
        await source.close()


@pytest.mark.iggy
async def test_provisioning_gives_the_gateway_a_token_and_the_agent_logs_in_with_it(
    iggy_server: IggyServer, tmp_path: Path
) -> None:
    admin = _settings(tmp_path, address=iggy_server.address, password=iggy_server.password)
    done = await provision_gateway(admin, "gw-1")
    assert done.token
    toml = done.credentials_toml()
    assert "token = " in toml
    assert "password" not in toml, "the gateway needs its token only"
    (tmp_path / "credentials.toml").write_text(toml)
    (tmp_path / "config.toml").write_text(
        f'gateway_id = "gw-1"\nstate_dir = "{tmp_path}"\ncredentials_file = "credentials.toml"\n'
        f'[iggy]\nkind = "iggy"\naddress = "{iggy_server.address}"\n'
    )
    settings = load_config(tmp_path / "config.toml", env={})
    assert settings.iggy.token is not None
    assert settings.iggy.password is None
    uplink, source = factory.make_uplink_and_source(settings)
    assert uplink is not None
    assert source is not None
    try:
        rt = return_topic(settings)
        assert await source.poll(rt.stream, rt.topic, 0, 0, 10) == []
        await uplink.send([_rec(1, "gw-1-dev0")])  # its route topics: send only
    finally:
        await uplink.close()
        await source.close()
