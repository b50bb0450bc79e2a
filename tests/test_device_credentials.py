"""`iggy-edge device credentials add|rotate|revoke|list` and `device ca init`
against a real Mosquitto started from the packaged snippet: the password
file is changed by mosquitto_passwd, the running broker reloads it (SIGHUP),
and logins follow without a restart."""

from __future__ import annotations

import json
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from iggy_edge import gateway_ca
from iggy_edge.cli.main import app
from iggy_edge.provision import credentials as creds
from typer.testing import CliRunner, Result

from tests.support.broker import mosquitto_binary
from tests.support.gateway_broker import GatewayBroker
from tests.support.wait import wait_until

runner = CliRunner()
PW = "sensor-password-0123456789"


@pytest.fixture
def gw() -> Iterator[GatewayBroker]:
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed: run .ci/setup")
    b = GatewayBroker().start()
    try:
        yield b
    finally:
        b.close()


def cli(gw: GatewayBroker, *args: str, env: dict[str, str] | None = None, pid: bool = True) -> Result:
    argv = ["device", "credentials", *args, "--passwd-file", str(gw.devices_passwd)]
    if pid and args[0] != "list":
        argv += ["--pid-file", str(gw.pid_file)]
    return runner.invoke(app, argv, env=env)


def _mqtt(gw: GatewayBroker, user: str, password: str, tool: str) -> list[str]:
    return [tool, "-h", gw.host, "-p", str(gw.device_port), "-u", user, "-P", password]


def login(gw: GatewayBroker, user: str, password: str) -> bool:
    done = subprocess.run(
        [*_mqtt(gw, user, password, "mosquitto_pub"), "-t", f"edge/{user}/up/t", "-m", "1", "-q", "1"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    return done.returncode == 0


def eventually_login(gw: GatewayBroker, user: str, password: str, expect: bool) -> None:
    # SIGHUP is asynchronous: the broker re-reads the file on its next loop turn
    wait_until(
        lambda: login(gw, user, password) is expect, 10, interval=0.1, what=f"login {user} -> {expect}"
    )


def test_add_rotate_revoke_list_take_effect_on_a_running_broker(gw: GatewayBroker) -> None:
    wait_until(gw.pid_file.exists, 5, what="pid file")
    pid = gw.proc.pid if gw.proc else 0
    assert not login(gw, "sensor-01", PW)
    mode_before = stat.S_IMODE(gw.devices_passwd.stat().st_mode)

    added = cli(gw, "add", "sensor-01", "--password-env", "SENSOR_PW", env={"SENSOR_PW": PW})
    assert added.exit_code == 0, added.output
    assert PW not in added.output  # given, so never printed
    assert f"sent SIGHUP to Mosquitto (pid {pid}" in added.output
    eventually_login(gw, "sensor-01", PW, True)
    assert stat.S_IMODE(gw.devices_passwd.stat().st_mode) == mode_before
    assert PW not in gw.devices_passwd.read_text()

    # generated: printed once, and it works
    gen = cli(gw, "add", "sensor-02")
    assert gen.exit_code == 0, gen.output
    generated = gen.output.strip().splitlines()[-1]
    assert "shown once" in gen.output
    assert len(generated) >= 24
    eventually_login(gw, "sensor-02", generated, True)

    listed = cli(gw, "list")
    assert listed.exit_code == 0
    assert listed.output.split() == ["sensor-01", "sensor-02"]
    as_json = cli(gw, "list", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) == {
        "passwd_file": str(gw.devices_passwd),
        "users": ["sensor-01", "sensor-02"],
    }

    again = cli(gw, "add", "sensor-01", "--password-env", "SENSOR_PW", env={"SENSOR_PW": PW})
    assert again.exit_code == 1
    assert "already has credentials" in again.output
    assert "use `rotate`" in again.output

    rotated = cli(gw, "rotate", "sensor-01", "--password-env", "NEW_PW", env={"NEW_PW": PW + "-new"})
    assert rotated.exit_code == 0, rotated.output
    eventually_login(gw, "sensor-01", PW, False)
    assert login(gw, "sensor-01", PW + "-new")

    revoked = cli(gw, "revoke", "sensor-02")
    assert revoked.exit_code == 0, revoked.output
    eventually_login(gw, "sensor-02", generated, False)
    assert cli(gw, "list").output.split() == ["sensor-01"]
    assert gw.proc is not None
    assert gw.proc.pid == pid  # never restarted
    assert gw.proc.poll() is None


def test_revoke_disconnects_a_connected_device(gw: GatewayBroker, tmp_path: Path) -> None:
    assert cli(gw, "add", "sensor-09", "--password-env", "P", env={"P": PW}).exit_code == 0
    eventually_login(gw, "sensor-09", PW, True)
    out = (tmp_path / "sub.log").open("wb")
    sub = subprocess.Popen(
        [*_mqtt(gw, "sensor-09", PW, "mosquitto_sub"), "-t", "edge/sensor-09/down/#", "-q", "1"],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: "as sensor-09" in gw.log(), 10, what="device connected")
        time.sleep(0.2)
        assert sub.poll() is None
        assert cli(gw, "revoke", "sensor-09").exit_code == 0
        # Mosquitto re-checks connected clients at the reload; mosquitto_sub
        # then cannot log in again and exits
        wait_until(lambda: sub.poll() is not None, 15, what="revoked device disconnected")
    finally:
        if sub.poll() is None:
            sub.kill()
        sub.wait()
        out.close()


def test_errors_are_clear(gw: GatewayBroker, tmp_path: Path) -> None:
    missing = tmp_path / "nope.passwd"
    r = runner.invoke(app, ["device", "credentials", "list", "--passwd-file", str(missing)])
    assert r.exit_code == 1
    assert f"no Mosquitto password file at {missing}" in r.output
    for bad, why in (
        ("sensor/01", "not usable as an MQTT user"),
        ("a+b", "not usable as an MQTT user"),
        ("iggy-edge-gw-acl", "reserved"),
        ("iggy-edge", "reserved"),
    ):
        r = cli(gw, "add", bad, "--password-env", "P", env={"P": PW})
        assert r.exit_code == 1
        assert why in r.output, r.output
    r = cli(gw, "add", "s-short", "--password-env", "P", env={"P": "short"})
    assert r.exit_code == 1
    assert "too short" in r.output
    assert "short" not in r.output.replace("too short", "")
    r = cli(gw, "add", "s-noenv", "--password-env", "IGGY_TEST_UNSET_VAR")
    assert "IGGY_TEST_UNSET_VAR is not set" in r.output
    r = cli(gw, "rotate", "ghost", "--password-env", "P", env={"P": PW})
    assert "ghost has no credentials" in r.output
    assert "use `add`" in r.output
    r = cli(gw, "revoke", "ghost")
    assert "ghost has no credentials" in r.output

    # the broker is not where expected
    dead = subprocess.Popen(["true"])
    dead.wait()
    argv = ["device", "credentials", "add", "s-dead", "--passwd-file", str(gw.devices_passwd)]
    r = runner.invoke(app, [*argv, "--broker-pid", str(dead.pid), "--password-env", "P"], env={"P": PW})
    assert r.exit_code == 1
    assert f"no Mosquitto runs as pid {dead.pid}" in r.output
    assert "s-dead" in cli(gw, "list").output  # the file was changed; only the reload failed
    r = runner.invoke(app, [*argv[:3], "s-dead2", *argv[4:], "--pid-file", str(tmp_path / "x.pid")])
    assert r.exit_code == 1
    assert "no pid file at" in r.output


@pytest.mark.unit
def test_reload_without_systemd_or_pid_file_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    if Path("/run/systemd/system").is_dir() or creds.MOSQUITTO_PID_FILE.exists():
        pytest.skip("a system Mosquitto may run here: not testing the 'none found' error")
    with pytest.raises(creds.CredentialsError, match="no running Mosquitto found to reload"):
        creds.reload_broker(creds.Reload())


# -- the gateway CA ---------------------------------------------------------------------------
@pytest.mark.unit
def test_ca_init_creates_once_and_issues_a_server_cert_for_the_names(tmp_path: Path) -> None:
    ca_dir, crt, key = tmp_path / "ca", tmp_path / "certs" / "server.crt", tmp_path / "certs" / "server.key"
    argv = [
        "device",
        "ca",
        "init",
        "--ca-dir",
        str(ca_dir),
        "--server-cert",
        str(crt),
        "--server-key",
        str(key),
    ]
    r = runner.invoke(app, [*argv, "--san", "gw.local", "--san", "192.168.1.10"])
    assert r.exit_code == 0, r.output
    assert "created the gateway CA" in r.output
    assert stat.S_IMODE((ca_dir / "ca.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(key.stat().st_mode) in (0o600, 0o640)
    ca = x509.load_der_x509_certificate((ca_dir / "ca.der").read_bytes())
    server = x509.load_pem_x509_certificate(crt.read_bytes())
    server.verify_directly_issued_by(ca)
    assert isinstance(server.public_key(), ec.EllipticCurvePublicKey)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gw.local"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["192.168.1.10"]
    ca_key = (ca_dir / "ca.key").read_bytes()

    # again: the CA is kept; a new name re-issues the server cert with both
    r = runner.invoke(app, [*argv, "--san", "gw.local"])
    assert "already covers" in r.output
    r = runner.invoke(app, [*argv, "--san", "10.0.0.5"])
    assert r.exit_code == 0, r.output
    assert (ca_dir / "ca.key").read_bytes() == ca_key
    names = set(creds_names(crt))
    assert names == {"gw.local", "192.168.1.10", "10.0.0.5"}
    x509.load_pem_x509_certificate(crt.read_bytes()).verify_directly_issued_by(ca)


def creds_names(crt: Path) -> list[str]:
    return gateway_ca.server_names(gateway_ca.CaPaths(server_cert=crt))
