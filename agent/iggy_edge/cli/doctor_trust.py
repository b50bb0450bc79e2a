"""Doctor's checks of the local trust boundaries (docs/operations.md,
"Trust: who can reach the agent's credentials"):

* broker-listener  the agent's loopback listener is held by Mosquitto on a
                   privileged port: found through the kernel's socket
                   tables (/proc/net/tcp{,6}: the listening socket's inode)
                   and the processes holding that inode (/proc/<pid>/fd),
                   with their user and name.  Anyone else there receives
                   the agent's CONNECT with its password.
* device-users     every name in the devices' password files is a device id
                   (device_ids: no '/', '+', '#', not reserved for the
                   agent), and the devices' listeners do not share the
                   agent's ACL file
* iggy-transport   the Iggy password does not go in clear to another host
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..config import Settings
from ..device_ids import device_id_problem
from .doctor_types import LOCAL_HOSTS, Check, Status, not_local_broker

LISTEN: Final = "0A"  # TCP_LISTEN in /proc/net/tcp
PROC: Final = Path("/proc")
AGENT_LISTENER_FIX: Final = (
    "use the packaged agent listener: 'listener 883 127.0.0.1' in /etc/mosquitto/conf.d/iggy-edge.conf and "
    "[mqtt] port = 883 in /etc/iggy-edge/config.toml, then systemctl restart mosquitto iggy-edge"
)
_RANK: Final[dict[Status, int]] = {"ok": 0, "skip": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class ListenSocket:
    address: str
    port: int
    uid: int  # who created the socket (Mosquitto creates it as root, then drops)
    inode: int


@dataclass(frozen=True)
class Owner:
    pid: int
    name: str
    uids: tuple[int, ...]  # real, effective


def _address(hex_addr: str) -> str:
    """A /proc/net/tcp{,6} address: 32-bit words in host byte order."""
    words = [int(hex_addr[i : i + 8], 16) for i in range(0, len(hex_addr), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening_sockets(port: int, proc: Path = PROC) -> list[ListenSocket]:
    """Every TCP socket listening on `port`, IPv4 and IPv6."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != LISTEN:
                continue
            addr, _, hex_port = f[1].partition(":")
            if int(hex_port, 16) == port:
                found.append(ListenSocket(_address(addr), port, int(f[7]), int(f[9])))
    return found


def socket_owners(inode: int, proc: Path = PROC) -> tuple[list[Owner], int]:
    """The processes holding socket `inode`, and how many processes' fds
    could not be read (another user's, without root)."""
    target = f"socket:[{inode}]"
    owners, unreadable = [], 0
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except PermissionError:
            unreadable += 1
            continue
        except OSError:
            continue  # the process ended
        for fd in fds:
            try:
                if os.readlink(fd) != target:
                    continue
                name = (pid_dir / "comm").read_text().strip()
                status = (pid_dir / "status").read_text()
            except OSError:
                continue
            uid_line = next((x for x in status.splitlines() if x.startswith("Uid:")), "Uid:")
            uids = tuple(int(u) for u in uid_line.split()[1:3])
            owners.append(Owner(int(pid_dir.name), name, uids))
            break
    return owners, unreadable


def unprivileged_port_start(proc: Path = PROC) -> int:
    try:
        return int((proc / "sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        return 1024


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _broker_uids() -> set[int]:
    try:
        return {0, pwd.getpwnam("mosquitto").pw_uid}
    except KeyError:
        return {0}


def _reaches(sock: ListenSocket, host: str) -> bool:
    """Whether a connection to `host` can land on `sock`."""
    wanted = {"127.0.0.1": {"127.0.0.1"}, "::1": {"::1"}, "localhost": {"127.0.0.1", "::1"}}[host]
    if "127.0.0.1" in wanted:
        wanted = wanted | {"0.0.0.0", "::", "::ffff:127.0.0.1"}  # noqa: S104 - compared, not bound
    if "::1" in wanted:
        wanted = wanted | {"::"}
    return sock.address in wanted


def _judge_socket(sock: ListenSocket, proc: Path) -> tuple[Status, str]:
    allowed = _broker_uids()
    owners, unreadable = socket_owners(sock.inode, proc)
    where = f"{sock.address}:{sock.port}"
    if not owners:
        if sock.uid not in allowed:
            return "fail", f"{where} is a socket of user {_user(sock.uid)}, not of the broker"
        # made by root or mosquitto: trusted, though which process holds it
        # is not visible to this user
        why = f" ({unreadable} processes not readable: sudo shows which)" if unreadable else ""
        return "ok", f"{where} is a socket of {_user(sock.uid)}{why}"
    worst: Status = "ok"
    notes = []
    for o in owners:
        who = f"{o.name} (pid {o.pid}, user {_user(o.uids[-1])})"
        if not set(o.uids) <= allowed:
            worst = "fail"
            notes.append(f"{where} is held by {who}, not by Mosquitto")
        elif o.name != "mosquitto":
            worst = max(worst, "warn", key=_RANK.__getitem__)
            notes.append(f"{where} is held by {who}, a privileged process that is not Mosquitto")
        else:
            notes.append(f"{where} is held by {who}")
    return worst, "; ".join(notes)


def check_agent_listener(settings: Settings, proc: Path = PROC) -> Check:
    """Who owns the socket the agent connects to, and whether an
    unprivileged user could take the port while the broker is down."""
    m = settings.mqtt
    if m.host not in LOCAL_HOSTS:
        return Check("broker-listener", "skip", f"broker on {m.host}: its sockets are not visible here")
    sockets = [s for s in listening_sockets(m.port, proc) if _reaches(s, m.host)]
    if not sockets:
        return Check(
            "broker-listener", "skip", f"nothing listens on {m.host}:{m.port} (see the broker check)"
        )
    status: Status = "ok"
    notes = []
    for s in sockets:
        st, note = _judge_socket(s, proc)
        status = max(status, st, key=_RANK.__getitem__)
        notes.append(note)
    start = unprivileged_port_start(proc)
    fix = ""
    if status == "fail":
        fix = (
            "something else holds the agent's port and receives its password: stop it, change the "
            "agent's MQTT password (mosquitto_passwd /etc/mosquitto/iggy-edge.passwd iggy-edge and "
            "IGGY_EDGE_MQTT_PASSWORD in /etc/iggy-edge/env), restart mosquitto; " + AGENT_LISTENER_FIX
        )
    if m.port >= start:
        notes.append(
            f"port {m.port} is not privileged (net.ipv4.ip_unprivileged_port_start = {start}): any local "
            "user can bind it while Mosquitto is down (restart, upgrade, crash, boot) and collect the "
            "agent's password"
        )
        status = max(status, "warn", key=_RANK.__getitem__)
        fix = fix or AGENT_LISTENER_FIX
    return Check("broker-listener", status, "; ".join(notes), fix)


# -- the broker's password files and ACLs --------------------------------------


@dataclass
class Listener:
    port: int | None  # None: the global section
    password_file: Path | None = None
    acl_file: Path | None = None


def mosquitto_listeners(conf: Path) -> list[Listener]:
    """The listeners of a Mosquitto config (and its include_dirs, in the
    order Mosquitto reads them) with their password and ACL files.  Raises
    OSError when a file cannot be read."""
    listeners = [Listener(None)]
    files, seen = [conf], set()
    while files:
        path = files.pop(0)
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.strip().partition(" ")
            value = value.strip()
            if key == "include_dir":
                files.extend(sorted(Path(value).glob("*.conf")))
            elif key == "listener":
                port = value.split()[0] if value else ""
                listeners.append(Listener(int(port) if port.isdigit() else None))
            elif key == "password_file":
                listeners[-1].password_file = Path(value)
            elif key == "acl_file":
                listeners[-1].acl_file = Path(value)
    return listeners


def password_file_users(path: Path) -> list[str]:
    return [
        line.split(":", 1)[0]
        for line in path.read_text(errors="surrogateescape").splitlines()
        if line.strip() and not line.startswith("#")
    ]


def check_device_users(settings: Settings, conf: Path) -> Check:
    """Names in the devices' password files that are not device ids, and a
    devices' listener sharing the agent's ACL."""
    if (skip := not_local_broker("device-users", settings, conf)) is not None:
        return skip
    try:
        listeners = mosquitto_listeners(conf)
    except OSError as e:
        return Check("device-users", "skip", f"cannot read the broker's config: {e}", "run doctor with sudo")
    agent = [x for x in listeners if x.port == settings.mqtt.port]
    devices = [x for x in listeners if x.port is not None and x.port != settings.mqtt.port]
    problems, fixes, users = [], [], 0
    agent_acls = {x.acl_file for x in agent if x.acl_file is not None}
    for d in devices:
        if d.acl_file is not None and d.acl_file in agent_acls:
            problems.append(
                f"listener {d.port} uses the agent's ACL {d.acl_file}: a device user named like the agent "
                "gets the agent's rights there"
            )
            fixes.append(
                "give the agent's listener its own acl_file (the packaged iggy-edge-agent.acl) and keep only "
                "the pattern lines in the devices' ACL"
            )
    for path in sorted({d.password_file for d in devices if d.password_file is not None}):
        try:
            names = password_file_users(path)
        except OSError as e:
            return Check("device-users", "skip", f"cannot read {path}: {e}", "run doctor with sudo")
        users += len(names)
        bad = [(n, p) for n in names if (p := device_id_problem(n)) is not None]
        for _name, problem in bad[:5]:
            problems.append(f"{path}: {problem}")
        if len(bad) > 5:
            problems.append(f"{path}: {len(bad) - 5} more such names")
        if bad:
            fixes.append(
                f"revoke them (iggy-edge device credentials revoke NAME --passwd-file {path}, or "
                f"mosquitto_passwd -D {path} NAME) and give those boards valid device ids"
            )
    if problems:
        return Check("device-users", "fail", "; ".join(problems), "; ".join(dict.fromkeys(fixes)))
    return Check("device-users", "ok", f"{users} device user(s), every name a device id")


def check_iggy_transport(settings: Settings) -> Check | None:
    """The Iggy login (user name and password) in clear to a remote node."""
    s = settings.iggy
    if s.kind != "iggy":
        return None
    remote = [a for a in s.nodes if a.rpartition(":")[0] not in LOCAL_HOSTS | {"[::1]"}]
    if s.tls or not remote:
        how = "TLS" if s.tls else "loopback only"
        return Check("iggy-transport", "ok", f"{how}: the Iggy password does not cross the network in clear")
    return Check(
        "iggy-transport",
        "warn",
        f"iggy.tls is off: the password of {s.username!r} goes in clear to {', '.join(remote)}",
        "enable TLS on the Iggy server and set iggy.tls = true (with tls_ca_file / tls_domain)",
    )
