"""The systemd service for pip installs: the unit, the example config, and
the steps `iggy-edge service install|uninstall` takes.

The Debian package ships packaging/systemd/iggy-edge.service; `UNIT` below
is that file (kept identical by a test), and `render_unit` points its
ExecStart at *this* installation's `iggy-edge`.  The steps are built here
and carried out (or only printed, with --dry-run) by the CLI; with a `root`
they write under that directory and skip what needs a live system (the
service user, systemctl).
"""

from __future__ import annotations

import pwd
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

SERVICE_USER: Final = "iggy-edge"
UNIT_NAME: Final = "iggy-edge.service"
UNIT_DIR: Final = Path("/etc/systemd/system")
STATE_DIR: Final = Path("/var/lib/iggy-edge")
PACKAGED_EXEC: Final = "/opt/iggy-edge/venv/bin/iggy-edge"
PACKAGED_CONFIG: Final = "/etc/iggy-edge/config.toml"

UNIT: Final = """\
# iggy-edge agent as a system service (installed by the Debian package, or
# written by `iggy-edge service install` with this venv's path in ExecStart).
# Local changes: `systemctl edit iggy-edge` (a drop-in), not this file.

[Unit]
Description=iggy-edge gateway agent (MQTT -> SQLite store-and-forward -> Apache Iggy)
Documentation=file:/usr/share/doc/iggy-edge/operations.md
Wants=network-online.target
After=network-online.target mosquitto.service
# At most 5 failed starts in 10 minutes, then stay failed (visible in
# `systemctl --failed`) rather than spinning on a broken install.
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart=/opt/iggy-edge/venv/bin/iggy-edge run -c /etc/iggy-edge/config.toml
# `systemctl reload iggy-edge`: the agent re-reads its config and takes what it
# can without a restart, logging what needs one (docs/operations.md).
ExecReload=/bin/kill -HUP $MAINPID
# Secrets (IGGY_PASSWORD, IGGY_EDGE_MQTT_PASSWORD, ...) live here, mode 0600.
EnvironmentFile=-/etc/iggy-edge/env
Environment=PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
User=iggy-edge
Group=iggy-edge
# /var/lib/iggy-edge (the buffer), owned by the service user; /etc/iggy-edge
# stays root-owned and read-only to the service.
StateDirectory=iggy-edge
StateDirectoryMode=0750
ConfigurationDirectory=iggy-edge
ConfigurationDirectoryMode=0755
UMask=0027

# Restart after a crash or a watchdog timeout, not after a clean stop and not
# after exit status 2 (invalid configuration: restarting will not fix it).
Restart=on-failure
RestartSec=5
RestartPreventExitStatus=2
# The agent pings every WatchdogSec/2 from its event loop (sd_notify); a
# wedged loop stops the pings and systemd restarts the service.
WatchdogSec=30
TimeoutStartSec=60
# SIGTERM: the agent stops ingest, finishes the batch in flight and closes
# the buffer within its 10 s shutdown timeout; this leaves room for that.
TimeoutStopSec=30
KillMode=mixed
# File descriptors: the agent needs a few dozen (SQLite, two MQTT clients,
# Iggy, at most 64 HTTP connections -- the endpoint caps itself); the
# headroom keeps a flood of local connections from starving MQTT reconnects.
LimitNOFILE=8192

# --- Sandboxing (check with: systemd-analyze security iggy-edge) ------------
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
ProcSubset=pid
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged @resources
SystemCallErrorNumber=EPERM
# A buffer outside /var/lib/iggy-edge (buffer.path) needs
#   ReadWritePaths=/that/directory
# in a drop-in (ProtectSystem=strict makes everything else read-only).

[Install]
WantedBy=multi-user.target
"""

EXAMPLE_CONFIG: Final = """\
# iggy-edge configuration, written by `iggy-edge service install`.
# Every key: docs/config.md.  Check: iggy-edge config check {config}; iggy-edge doctor
# Secrets go in /etc/iggy-edge/env (IGGY_PASSWORD=..., IGGY_EDGE_MQTT_PASSWORD=...).
gateway_id = "{gateway}"
state_dir = "/var/lib/iggy-edge"

[mqtt]
host = "127.0.0.1"
# 1883 is a plain Mosquitto.  With iggy-edge's Mosquitto snippet
# (packaging/mosquitto/iggy-edge.conf: the devices on 1883, the agent alone on
# the privileged loopback listener 127.0.0.1:883) the agent connects to 883.
port = 1883

[iggy]
kind = "none"   # "iggy" with address = "host:8090" to forward
"""


def render_unit(executable: str, config: Path) -> str:
    """The unit with this installation's executable and config path.

    ProtectHome=yes hides /home, /root and /run/user from the service; an
    agent installed in a venv under one of them gets ProtectHome=read-only."""
    unit = UNIT.replace(
        f"ExecStart={PACKAGED_EXEC} run -c {PACKAGED_CONFIG}", f"ExecStart={executable} run -c {config}"
    )
    if any(executable.startswith(p) or str(config).startswith(p) for p in ("/home/", "/root/", "/run/user/")):
        unit = unit.replace(
            "ProtectHome=yes",
            "# installed under a home directory: the service must be able to read it\nProtectHome=read-only",
        )
    return unit


@dataclass
class Step:
    describe: str
    run: Callable[[], None]


def _run(*argv: str) -> Callable[[], None]:
    def go() -> None:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {(done.stderr or done.stdout).strip()}")

    return go


def _write(path: Path, text: str, mode: int) -> Callable[[], None]:
    def go() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        path.chmod(mode)

    return go


def _mkdir(path: Path, mode: int, owner: str | None) -> Callable[[], None]:
    def go() -> None:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
        if owner is not None:
            shutil.chown(path, owner, owner)

    return go


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def gateway_name() -> str:
    """This host's name as a gateway id (the example config, the .deb's postinst)."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:64].strip("-_")
    return name or "gateway-01"


def unit_path(root: Path | None) -> Path:
    return (root or Path("/")) / UNIT_DIR.relative_to("/") / UNIT_NAME


def install_steps(
    exe: str, config: Path, root: Path | None, *, enable: bool, start: bool
) -> tuple[list[Step], Path, str]:
    """What `service install` does, in order, with the unit's path and text.
    `config` is absolute."""
    base = root or Path("/")
    path = unit_path(root)
    config_path = base / config.relative_to("/")
    unit = render_unit(exe, config)
    steps: list[Step] = []
    live = root is None
    if live and not user_exists(SERVICE_USER):
        steps.append(
            Step(
                f"create system user {SERVICE_USER}",
                _run(
                    "useradd",
                    "--system",
                    "--user-group",
                    "--home-dir",
                    str(STATE_DIR),
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    "--comment",
                    "iggy-edge agent",
                    SERVICE_USER,
                ),
            )
        )
    steps.append(
        Step(
            f"create {base / STATE_DIR.relative_to('/')} (0750, owned by {SERVICE_USER})",
            _mkdir(base / STATE_DIR.relative_to("/"), 0o750, SERVICE_USER if live else None),
        )
    )
    if not config_path.exists():
        text = EXAMPLE_CONFIG.format(config=config, gateway=gateway_name())
        steps.append(Step(f"write an example config to {config_path}", _write(config_path, text, 0o644)))
    steps.append(Step(f"write {path} (ExecStart={exe} run -c {config})", _write(path, unit, 0o644)))
    if live:
        steps.append(Step("systemctl daemon-reload", _run("systemctl", "daemon-reload")))
        if enable:
            steps.append(Step(f"systemctl enable {UNIT_NAME}", _run("systemctl", "enable", UNIT_NAME)))
        if start:
            steps.append(Step(f"systemctl restart {UNIT_NAME}", _run("systemctl", "restart", UNIT_NAME)))
    return steps, path, unit


def uninstall_steps(root: Path | None) -> list[Step]:
    """What `service uninstall` does: stop, disable, remove the unit; the
    config, the secrets, the buffer and the user stay."""
    path = unit_path(root)
    steps: list[Step] = []
    if root is None:
        steps.append(
            Step(f"systemctl disable --now {UNIT_NAME}", _run("systemctl", "disable", "--now", UNIT_NAME))
        )
    steps.append(Step(f"remove {path}", lambda: path.unlink(missing_ok=True)))
    if root is None:
        steps.append(Step("systemctl daemon-reload", _run("systemctl", "daemon-reload")))
    return steps
