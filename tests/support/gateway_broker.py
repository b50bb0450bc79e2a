"""A real Mosquitto started from the files the package ships
(packaging/mosquitto/iggy-edge.conf, iggy-edge-agent.acl and iggy-edge.acl),
with only ports and
paths rewritten to a temp dir: the agent's loopback listener, the devices'
listener and, when asked, the TLS listener (uncommented as an administrator
would)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .broker import mosquitto_binary
from .ports import free_port, wait_port

REPO = Path(__file__).resolve().parents[2]
SNIPPET = REPO / "packaging" / "mosquitto" / "iggy-edge.conf"
ACL = REPO / "packaging" / "mosquitto" / "iggy-edge.acl"
AGENT_ACL = REPO / "packaging" / "mosquitto" / "iggy-edge-agent.acl"
AGENT_USER = "iggy-edge"
TLS_LINES = re.compile(
    r"^#((?:listener 8883|allow_anonymous|password_file|acl_file|use_username_as_clientid|certfile|keyfile"
    r"|tls_version)\b.*)$",
    re.MULTILINE,
)


def add_user(passwd: Path, user: str, password: str) -> None:
    subprocess.run(
        ["mosquitto_passwd", str(passwd), user],
        input=f"{password}\n{password}\n",
        capture_output=True,
        text=True,
        check=True,
    )


@dataclass
class GatewayBroker:
    agent_password: str = "agent-pw-0123456789"
    devices: dict[str, str] = field(default_factory=dict)
    tls_cert: Path | None = None  # with tls_key: enable the TLS listener
    tls_key: Path | None = None
    agent_port: int = field(default_factory=free_port)
    device_port: int = field(default_factory=free_port)
    tls_port: int = field(default_factory=free_port)
    workdir: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"
    # As packaging/systemd/mosquitto-iggy-edge.conf runs it: the mosquitto
    # user with only CAP_NET_BIND_SERVICE (needs root to start it so).
    as_mosquitto: bool = False

    def __post_init__(self) -> None:
        # Mosquitto drops to its own user when started as root (unless told
        # `user root`): a world-readable directory keeps either way working.
        self.workdir = Path(tempfile.mkdtemp(prefix="iggy-edge-gw-mosq-"))
        self.workdir.chmod(0o755)

    @property
    def agent_passwd(self) -> Path:
        return self.workdir / "iggy-edge.passwd"

    @property
    def devices_passwd(self) -> Path:
        return self.workdir / "iggy-edge-devices.passwd"

    @property
    def acl(self) -> Path:
        return self.workdir / "iggy-edge.acl"

    @property
    def agent_acl(self) -> Path:
        return self.workdir / "iggy-edge-agent.acl"

    @property
    def conf_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def pid_file(self) -> Path:
        return self.workdir / "mosquitto.pid"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def conf_text(self) -> str:
        snippet = SNIPPET.read_text()
        for old, new in (
            ("listener 883 127.0.0.1", f"listener {self.agent_port} 127.0.0.1"),
            ("listener 1883\n", f"listener {self.device_port} 127.0.0.1\n"),
            ("/etc/mosquitto/iggy-edge-devices.passwd", str(self.devices_passwd)),
            ("/etc/mosquitto/iggy-edge.passwd", str(self.agent_passwd)),
            ("/etc/mosquitto/iggy-edge-agent.acl", str(self.agent_acl)),
            ("/etc/mosquitto/iggy-edge.acl", str(self.acl)),
        ):
            assert old in snippet, f"the packaged snippet changed: {old!r} is gone"
            snippet = snippet.replace(old, new)
        if self.tls_cert is not None and self.tls_key is not None:
            snippet = TLS_LINES.sub(r"\1", snippet)
            snippet = snippet.replace("listener 8883", f"listener {self.tls_port} 127.0.0.1")
            snippet = snippet.replace("/etc/mosquitto/certs/iggy-edge-server.crt", str(self.tls_cert))
            snippet = snippet.replace("/etc/mosquitto/certs/iggy-edge-server.key", str(self.tls_key))
        run_as = "user root\n" if os.geteuid() == 0 and not self.as_mosquitto else ""
        # What Debian's /etc/mosquitto/mosquitto.conf adds before including conf.d.
        head = (
            f"{run_as}pid_file {self.pid_file}\npersistence true\npersistence_location {self.workdir}/\n"
            f"log_dest file {self.log_path}\nlog_type error\nlog_type warning\nlog_type notice\n"
            "log_type information\nlog_type debug\n"
        )
        return head + snippet

    def start(self) -> GatewayBroker:
        binary = mosquitto_binary()
        assert binary is not None, "mosquitto is not installed (run .ci/setup)"
        shutil.copyfile(ACL, self.acl)
        shutil.copyfile(AGENT_ACL, self.agent_acl)
        for p in (self.agent_passwd, self.devices_passwd):
            if not p.exists():
                p.touch()
        if not self.agent_passwd.read_text():
            add_user(self.agent_passwd, AGENT_USER, self.agent_password)
        for user, pw in self.devices.items():
            add_user(self.devices_passwd, user, pw)
        for p in (self.agent_passwd, self.devices_passwd, self.acl, self.agent_acl):
            p.chmod(0o644)
        conf = self.conf_path
        conf.write_text(self.conf_text())
        argv = [binary, "-c", str(conf)]
        if self.as_mosquitto:
            shutil.chown(self.workdir, "mosquitto")  # persistence, log, pid file
            caps = ["--inh-caps=+net_bind_service", "--ambient-caps=+net_bind_service"]
            argv = ["setpriv", "--reuid=mosquitto", "--regid=mosquitto", "--init-groups", *caps, *argv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(self.agent_port)
            wait_port(self.device_port)
            if self.tls_cert is not None:
                wait_port(self.tls_port)
        except TimeoutError:
            self.stop()
            raise AssertionError("mosquitto did not start:\n" + self.log()) from None
        return self

    def reload(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> GatewayBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
