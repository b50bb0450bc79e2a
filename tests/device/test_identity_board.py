"""A provisioned board's identity, end to end: the files `device provision`
stages (config.local.json with the MQTT credentials, the CA certificate for
TLS) run under the MicroPython Unix port with the real umqtt.simple, against
Mosquitto started from the packaged snippet and ACL, with the agent's real
runtime ingesting into the memory uplink.

Only the board's timing (period, cycles, back-off) is shortened in the
staged config.json; identity and secrets are what provisioning wrote.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from iggy_edge import gateway_ca
from iggy_edge.cli.main import app
from iggy_edge.config import Settings
from iggy_edge.provision import ProvisionError
from iggy_edge.provision.sources import source_root
from iggy_edge.provision.staging import Staged, prepare
from iggy_edge.uplink.memory import MemoryIggy
from typer.testing import CliRunner

from tests.support.agent import make_settings, running_agent
from tests.support.gateway_broker import AGENT_USER, GatewayBroker
from tests.support.micropython import MPLIB_DIR, Board, Flash, require_micropython
from tests.support.staging import MQTT_PASSWORD, stage_env_sensor
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.micropython

PW = MQTT_PASSWORD
FAST = {"period_ms": 50, "backoff_base_ms": 100, "backoff_max_ms": 400, "wdt_ms": 0}


@pytest.fixture
def gw() -> Iterator[GatewayBroker]:
    b = GatewayBroker()
    yield b
    b.close()


def provisioned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dev: str, port: int, **kw: object
) -> tuple[Flash, Staged]:
    """What provisioning copies to the board, laid out as the board's flash
    (umqtt as `mip install umqtt.simple` puts it in /lib)."""
    require_micropython()
    staged = stage_env_sensor(tmp_path / "staging", monkeypatch, dev, port, **kw)
    flash = Flash(tmp_path / "flash")
    for board_path, src in staged.files.items():
        dst = flash.root / board_path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    shutil.copytree(MPLIB_DIR / "umqtt", flash.root / "lib" / "umqtt")
    return flash, staged


def retime(flash: Flash, **extra: object) -> None:
    cfg = json.loads(flash.text("config.json"))
    cfg.update(FAST, **extra)
    (flash.root / "config.json").write_text(json.dumps(cfg))


def _readings(iggy: MemoryIggy, dev: str) -> list[bytes]:
    if ("edge", "telemetry") not in iggy.topics:
        return []
    out = []
    for p in range(3):
        out += [m.payload for m in iggy.messages("edge", "telemetry", p)]
    return [x for x in out if b'"sim"' in x and x]


def agent_settings(tmp_path: Path, gw: GatewayBroker) -> Settings:
    mqtt = {"host": gw.host, "port": gw.agent_port, "username": AGENT_USER, "password": gw.agent_password}
    return make_settings(tmp_path, None, gateway_id="gw-board", mqtt=mqtt, iggy={"partitions": 3})


def not_authorized_delays(console: str) -> list[int]:
    return [int(m) for m in re.findall(r"not authorized \(CONNACK 5\).*retry in (\d+) ms", console)]


async def test_provisioned_board_gets_in_once_credentials_are_added_without_a_broker_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gw: GatewayBroker
) -> None:
    dev = "env-prov-1"
    gw.start()
    flash, staged = provisioned(tmp_path, monkeypatch, dev, gw.device_port)
    # what provisioning staged: credentials in the git-ignored local file only
    local = json.loads(flash.text("config.local.json"))
    assert local == {"wifi_password": "wifi-secret", "user": dev, "password": PW}
    assert (staged.files["config.local.json"].stat().st_mode & 0o777) == 0o600
    cfg = json.loads(flash.text("config.json"))
    assert (cfg["device_id"], cfg["port"], cfg["user"], cfg["password"]) == (dev, gw.device_port, None, None)
    assert PW not in flash.text("config.json")
    retime(flash, auth_backoff_base_ms=200, auth_backoff_max_ms=400)

    iggy = MemoryIggy(partitions=3)
    pid = gw.proc.pid if gw.proc else 0
    board = Board(flash)
    async with running_agent(agent_settings(tmp_path, gw), iggy.uplink()):
        board.start()
        try:
            # not registered yet: refused, and the board says why
            await async_wait_until(lambda: not_authorized_delays(board.console()), 20, what="refused")
            env = {"IGGY_TEST_MQTT_PW": PW}
            argv = ["device", "credentials", "add", dev, "--password-env", "IGGY_TEST_MQTT_PW"]
            argv += ["--passwd-file", str(gw.devices_passwd), "--broker-pid", str(pid)]
            done = CliRunner().invoke(app, argv, env=env)
            assert done.exit_code == 0, done.output
            assert f"added MQTT user {dev}" in done.output
            assert "sent SIGHUP to Mosquitto" in done.output
            assert PW not in done.output
            await async_wait_until(lambda: len(_readings(iggy, dev)) >= 5, 30, what="telemetry in Iggy")
        finally:
            board.stop()
    assert gw.proc is not None
    assert gw.proc.pid == pid
    assert gw.proc.poll() is None  # reloaded, never restarted
    assert "connected to 127.0.0.1" in board.console()


def test_wrong_password_is_reported_as_not_authorized_and_backs_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gw: GatewayBroker
) -> None:
    dev = "env-badpw-1"
    gw.devices[dev] = "the-real-password-000"
    gw.start()
    flash, _ = provisioned(tmp_path, monkeypatch, dev, gw.device_port)  # provisioned with PW: wrong
    base, cap = 100, 800
    retime(flash, auth_backoff_base_ms=base, auth_backoff_max_ms=cap, cycles=80)  # 80 x 50 ms = 4 s
    board = Board(flash).start()
    assert board.wait(60) == 0
    console = board.console()
    delays = not_authorized_delays(console)
    done = board.done()
    # distinct, counted, and the ordinary backoff was not used for it
    assert len(delays) == done["auth_failures"] == done["conn_failures"], console[-2000:]
    assert done["connects"] == 0
    assert "as user 'env-badpw-1'" in console
    # equal jitter: attempt i waits between ceil/2 and ceil, ceil = min(base << i, cap)
    for i, d in enumerate(delays):
        ceiling = min(base << i, cap)
        assert ceiling // 2 <= d <= ceiling, (i, delays)
    assert delays[-1] >= cap // 2
    assert delays[3] > delays[0]
    # no hammering: about 4 s of running allow only a handful of attempts
    assert 3 <= len(delays) <= 10, delays
    # the broker saw exactly those attempts (Mosquitto 2.0 logs a refused login so)
    attempts = gw.log().count("Sending CONNACK to 127.0.0.1 (0, 5)")
    assert attempts == len(delays), (attempts, delays)


# -- TLS ---------------------------------------------------------------------------------
def make_ca(tmp_path: Path, name: str) -> gateway_ca.CaPaths:
    d = tmp_path / name
    paths = gateway_ca.CaPaths(ca_dir=d / "ca", server_cert=d / "server.crt", server_key=d / "server.key")
    gateway_ca.init(paths, name, ["127.0.0.1", "localhost"])
    # the broker here may run as the mosquitto user: let it read the test's key
    for p in (d, d / "ca", paths.server_key):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return paths


async def test_board_connects_over_tls_and_verifies_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = "env-tls-1"
    paths = make_ca(tmp_path, "gw-tls")
    gw = GatewayBroker(devices={dev: PW}, tls_cert=paths.server_cert, tls_key=paths.server_key)
    try:
        gw.start()
        flash, staged = provisioned(
            tmp_path,
            monkeypatch,
            dev,
            gw.tls_port,
            tls=True,
            ca_cert=paths.ca_der,
            server_cert=paths.server_cert,
        )
        cfg = json.loads(flash.text("config.json"))
        assert (cfg["tls"], cfg["ca_file"]) == (True, "ca.der")
        assert flash.path("ca.der").read_bytes() == paths.ca_der.read_bytes()
        assert "ca.der" in staged.files
        retime(flash)
        iggy = MemoryIggy(partitions=3)
        board = Board(flash)
        async with running_agent(agent_settings(tmp_path, gw), iggy.uplink()):
            board.start()
            try:
                await async_wait_until(lambda: len(_readings(iggy, dev)) >= 5, 30, what="telemetry over TLS")
            finally:
                board.stop()
        assert "connected to 127.0.0.1" in board.console()
    finally:
        gw.close()


def test_board_refuses_a_broker_its_ca_did_not_sign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = "env-tls-2"
    real = make_ca(tmp_path, "gw-real")
    other = make_ca(tmp_path, "gw-other")  # an impostor gateway with its own CA
    gw = GatewayBroker(devices={dev: PW}, tls_cert=other.server_cert, tls_key=other.server_key)
    try:
        gw.start()
        flash, _ = provisioned(
            tmp_path,
            monkeypatch,
            dev,
            gw.tls_port,
            tls=True,
            ca_cert=real.ca_der,
            server_cert=real.server_cert,
        )
        retime(flash, cycles=20)
        board = Board(flash).start()
        assert board.wait(60) == 0
        console = board.console()
        done = board.done()
        assert done["connects"] == 0
        assert done["conn_failures"] >= 1
        assert done["auth_failures"] == 0
        assert "mqtt connect failed:" in console
        assert "verif" in console.lower() or "certificate" in console.lower(), console[-2000:]
        assert f"as {dev}" not in gw.log()  # never got as far as sending the password
    finally:
        gw.close()


def test_provisioning_refuses_tls_when_the_broker_certificate_does_not_name_the_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = make_ca(tmp_path, "gw-names")
    monkeypatch.setenv("IGGY_TEST_MQTT_PW", PW)
    with pytest.raises(ProvisionError, match=r"not valid for '10\.9\.8\.7'"):
        prepare(
            source_root(),
            "env_sensor",
            tmp_path,
            device_id="env-x",
            wifi_ssid="lab",
            wifi_password="w",
            broker="10.9.8.7",
            broker_port=None,
            mqtt_password_env="IGGY_TEST_MQTT_PW",
            tls=True,
            ca_cert=paths.ca_der,
            server_cert=paths.server_cert,
        )
