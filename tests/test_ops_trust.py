"""Local trust boundaries of a gateway (issue 18, items 4, 8, 9): who holds
the agent's listener (doctor), the devices' listener with its own ACL (a
real Mosquitto from the packaged snippet), the names in the devices'
password file, and the Iggy password in clear."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from iggy_edge.broker_checks import check_device_users
from iggy_edge.broker_listener import check_agent_listener, listening_sockets
from iggy_edge.checks import Check
from iggy_edge.cli.main import app
from iggy_edge.config import Settings, parse_config
from iggy_edge.uplink.iggy.check import check_iggy_transport
from typer.testing import CliRunner

from tests.support.broker import Broker
from tests.support.gateway_broker import AGENT_USER, GatewayBroker, add_user
from tests.support.ports import free_port, wait_port
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parent.parent
SNIPPET = REPO / "packaging" / "mosquitto" / "iggy-edge.conf"
PACKAGED_CONFIG = REPO / "packaging" / "config" / "config.toml"
DROP_IN = REPO / "packaging" / "systemd" / "mosquitto-iggy-edge.conf"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="binds a privileged port: needs root")


def settings_for(port: int, **iggy: object) -> Settings:
    raw: dict[str, object] = {"gateway_id": "gw-trust", "mqtt": {"host": "127.0.0.1", "port": port}}
    if iggy:
        raw["iggy"] = iggy
    return parse_config(raw, source="test", env={})


def free_privileged_port() -> int:
    """A port below 1024 nothing listens on (tests run as root)."""
    for port in range(990, 800, -1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 801..990")


# -- item 4: the agent's listener ------------------------------------------------------


def test_packaged_agent_listener_is_a_privileged_loopback_port() -> None:
    snippet = SNIPPET.read_text()
    assert "\nlistener 883 127.0.0.1\n" in snippet
    assert "listener 1884" not in snippet
    assert "port = 883\n" in PACKAGED_CONFIG.read_text()
    assert int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()) > 883


def test_doctor_flags_a_listener_held_by_another_process() -> None:
    """The test's own Python socket where the broker should be: not Mosquitto
    and an unprivileged port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert [x.port for x in listening_sockets(port)] == [port]
        check = check_agent_listener(settings_for(port))
    assert check.status in ("warn", "fail"), check
    assert f"port {port} is not privileged" in check.detail
    if os.geteuid() == 0:
        assert "not Mosquitto" in check.detail, check.detail
        assert f"pid {os.getpid()}" in check.detail
    assert "listener 883 127.0.0.1" in check.fix


@pytest.fixture
def squatter() -> Iterator[int]:
    """An unprivileged user (nobody) listening where the agent connects."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    port = free_port()
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != b"up":
            pytest.skip(f"cannot run python as nobody: {proc.stderr.read() if proc.stderr else b''!r}")
        wait_port(port)
        yield port
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_doctor_fails_a_listener_held_by_an_unprivileged_user(squatter: int) -> None:
    check = check_agent_listener(settings_for(squatter))
    assert check.status == "fail", check
    assert "user nobody" in check.detail, check.detail
    assert "not by Mosquitto" in check.detail
    assert "change the agent's MQTT password" in check.fix


@root_only
def test_mosquitto_as_the_drop_in_runs_it_holds_a_privileged_port_and_doctor_passes() -> None:
    """A real Mosquitto from the packaged snippet, run as the packaged
    mosquitto.service drop-in does (user mosquitto, only CAP_NET_BIND_SERVICE),
    the agent's listener on a port below 1024: held by mosquitto: ok."""
    with GatewayBroker(agent_port=free_privileged_port(), as_mosquitto=True) as gw:
        check = check_agent_listener(settings_for(gw.agent_port))
        ok = pub(gw.agent_port, AGENT_USER, gw.agent_password, "edge/x/down/cmd", "1")
    assert check.status == "ok", check
    assert "is held by mosquitto" in check.detail
    assert "user mosquitto" in check.detail
    assert ok.returncode == 0, ok.stderr


@root_only
def test_mosquitto_started_as_root_cannot_bind_a_privileged_port(tmp_path: Path) -> None:
    """Why the drop-in exists: Mosquitto 2.0.11 started as root drops to its
    user before it opens its listeners."""
    workdir = tmp_path / "m"
    workdir.mkdir()
    workdir.chmod(0o755)
    tmp_path.chmod(0o755)
    conf = workdir / "m.conf"
    conf.write_text(f"listener {free_privileged_port()} 127.0.0.1\nallow_anonymous true\n")
    done = subprocess.run(
        ["mosquitto", "-c", str(conf)], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode != 0
    assert "Permission denied" in done.stdout + done.stderr


def test_mosquitto_drop_in_passes_systemd_analyze(tmp_path: Path) -> None:
    unit = Path("/lib/systemd/system/mosquitto.service")
    tool = shutil.which("systemd-analyze")
    if tool is None or not unit.exists():
        pytest.skip("needs systemd-analyze and Debian's mosquitto.service")
    text = DROP_IN.read_text()
    for line in ("User=mosquitto", "AmbientCapabilities=CAP_NET_BIND_SERVICE", "ExecStartPre=\n"):
        assert line in text
    shutil.copy(unit, tmp_path / unit.name)
    (tmp_path / "mosquitto.service.d").mkdir()
    shutil.copy(DROP_IN, tmp_path / "mosquitto.service.d" / "iggy-edge.conf")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{tmp_path}:"}
    done = subprocess.run(
        [tool, "verify", str(tmp_path / unit.name)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "iggy-edge.conf" not in done.stderr, done.stderr


def test_doctor_skips_when_nothing_listens() -> None:
    assert check_agent_listener(settings_for(free_port())).status == "skip"


# -- item 8: the devices' listener has its own ACL -------------------------------------


class Sub:
    """mosquitto_sub that exits after its first message; its output and whether it subscribed."""

    def __init__(self, workdir: Path, port: int, user: str, password: str, filters: list[str]) -> None:
        self.out = workdir / f"sub-{user}-{port}.log"
        argv = [
            "stdbuf",
            "-oL",
            "mosquitto_sub",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "-u",
            user,
            "-P",
            password,
        ]
        argv += ["-d", "-v", "-q", "1", "-C", "1", "-W", "20"]
        for f in filters:
            argv += ["-t", f]
        self._file = self.out.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._file, stderr=subprocess.STDOUT)
        wait_until(lambda: "Subscribed (mid" in self.text() or self.proc.poll() is not None, 10)
        assert "Subscribed (mid" in self.text(), self.text()

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def first_message(self) -> str:
        self.proc.wait(timeout=25)
        self._file.close()
        lines = [x for x in self.text().splitlines() if x.startswith("edge/")]
        assert lines, self.text()
        return lines[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._file.close()


def pub(port: int, user: str, password: str, topic: str, payload: str) -> subprocess.CompletedProcess[str]:
    argv = ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-u", user, "-P", password]
    return subprocess.run(
        [*argv, "-q", "1", "-t", topic, "-m", payload],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )


DEVICES = {AGENT_USER: "lan-user-pw-1", "s1": "s1-password-1", "x": "x-password-01"}


def test_a_device_user_named_like_the_agent_gets_no_agent_rights(tmp_path: Path) -> None:
    """`mosquitto_passwd iggy-edge-devices.passwd iggy-edge` by hand: on the
    devices' listener that user reads no other device's readings and writes
    no command; the agent's user on its own listener does both."""
    subs: list[Sub] = []
    with GatewayBroker(devices=dict(DEVICES)) as gw:
        dev, ag, apw = gw.device_port, gw.agent_port, gw.agent_password
        try:
            agent_up = Sub(tmp_path, ag, AGENT_USER, apw, ["edge/+/up/#"])
            subs.append(agent_up)
            victim = Sub(tmp_path, dev, "x", DEVICES["x"], ["edge/x/down/#"])
            subs.append(victim)
            # (before the LAN user subscribes: its client id is its user name,
            # so its publisher would take over the subscriber's session)
            lan_cmd = pub(dev, AGENT_USER, DEVICES[AGENT_USER], "edge/x/down/cmd", "evil")
            assert lan_cmd.returncode == 0, lan_cmd.stderr  # MQTT 3.1.1: a denied PUBLISH is just dropped
            lan_filters = ["edge/+/up/#", "edge/iggy-edge/down/marker"]
            lan = Sub(tmp_path, dev, AGENT_USER, DEVICES[AGENT_USER], lan_filters)
            subs.append(lan)

            assert pub(dev, "s1", DEVICES["s1"], "edge/s1/up/t", "reading").returncode == 0
            assert agent_up.first_message() == "edge/s1/up/t reading"  # the agent reads it
            # Markers from the agent, after the message and the command: each
            # subscriber's first message says whether the earlier one reached it.
            assert pub(ag, AGENT_USER, apw, "edge/iggy-edge/down/marker", "m").returncode == 0
            assert pub(ag, AGENT_USER, apw, "edge/x/down/cmd", "marker").returncode == 0
            assert lan.first_message() == "edge/iggy-edge/down/marker m"
            assert victim.first_message() == "edge/x/down/cmd marker"
        finally:
            for s in subs:
                s.close()
        assert "Denied PUBLISH" in gw.log()


def test_doctor_flags_names_that_are_not_device_ids(tmp_path: Path) -> None:
    gw = GatewayBroker(devices={})
    try:
        gw.devices_passwd.touch()
        for name in ("env-01", AGENT_USER, "victim/up/x"):
            add_user(gw.devices_passwd, name, "password-123")
        gw.agent_passwd.touch()
        conf = tmp_path / "mosquitto.conf"
        conf.write_text(gw.conf_text())
        check = check_device_users(settings_for(gw.agent_port), conf)
        assert check.status == "fail", check
        assert "'iggy-edge' is reserved" in check.detail
        assert "'victim/up/x' is not usable" in check.detail
        assert "env-01" not in check.detail
        assert "mosquitto_passwd -D" in check.fix

        gw.devices_passwd.write_text("")
        add_user(gw.devices_passwd, "env-01", "password-123")
        ok = check_device_users(settings_for(gw.agent_port), conf)
        assert ok.status == "ok", ok
        assert "1 device user(s)" in ok.detail

        # an upgraded install that kept one ACL for both listeners
        shared = conf.read_text().replace(str(gw.agent_acl), str(gw.acl))
        conf.write_text(shared)
        one_acl = check_device_users(settings_for(gw.agent_port), conf)
        assert one_acl.status == "fail"
        assert "uses the agent's ACL" in one_acl.detail
    finally:
        gw.close()


# -- item 9: the Iggy password in clear ------------------------------------------------


def transport(**iggy: object) -> Check:
    check = check_iggy_transport(settings_for(1883, kind="iggy", **iggy))
    assert check is not None
    return check


def test_doctor_warns_when_the_iggy_password_goes_in_clear_to_another_host() -> None:
    remote = transport(address="iggy.example.net:8090")
    assert remote.status == "warn", remote
    assert "goes in clear to iggy.example.net:8090" in remote.detail
    assert "iggy.tls = true" in remote.fix
    assert transport(address="iggy.example.net:8090", tls=True).status == "ok"
    assert transport(address="127.0.0.1:8090").status == "ok"
    cluster = transport(addresses=["127.0.0.1:8090", "iggy-2.example.net:8090"])
    assert cluster.status == "warn"
    assert "to iggy-2.example.net:8090" in cluster.detail
    assert "127.0.0.1" not in cluster.detail
    assert check_iggy_transport(settings_for(1883)) is None  # kind = none: nothing sent


def test_doctor_command_reports_the_listener_and_device_users(tmp_path: Path, broker: Broker) -> None:
    """Through `iggy-edge doctor`: the test broker (a Mosquitto on an
    unprivileged port) is flagged, with the fix; the exit status stays 0 (a
    warning)."""
    config = tmp_path / "config.toml"
    config.write_text(
        f'gateway_id = "gw-doc"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "127.0.0.1"\nport = {broker.port}\n[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
    )
    argv = ["doctor", "-c", str(config), "--env-file", str(tmp_path / "no-env")]
    argv += ["--mosquitto-conf", str(broker.workdir / "mosquitto.conf")]
    done = CliRunner().invoke(app, [*argv, "--json"])
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["broker-listener"]["status"] == "warn", checks["broker-listener"]
    assert f"port {broker.port} is not privileged" in checks["broker-listener"]["detail"]
    assert checks["device-users"]["status"] == "ok"  # no password files in the test broker's config
    text = CliRunner().invoke(app, argv)
    assert "! broker-listener:" in text.stdout
    assert "fix: use the packaged agent listener: 'listener 883 127.0.0.1'" in text.stdout
    assert done.exit_code == text.exit_code == 0
