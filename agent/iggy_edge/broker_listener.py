"""Doctor's broker-listener check (docs/operations.md, "Trust: who can
reach the agent's credentials"): the agent's loopback listener is held by
Mosquitto on a privileged port.  Found through the kernel's socket tables
(/proc/net/tcp{,6}: the listening socket's inode) and the processes holding
that inode (/proc/<pid>/fd), with their user and name.  Anyone else there
receives the agent's CONNECT with its password.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .checks import LOCAL_HOSTS, Check, Status, worse
from .config import Settings

LISTEN: Final = "0A"  # TCP_LISTEN in /proc/net/tcp
PROC: Final = Path("/proc")
AGENT_LISTENER_FIX: Final = (
    "use the packaged agent listener: 'listener 883 127.0.0.1' in /etc/mosquitto/conf.d/iggy-edge.conf and "
    "[mqtt] port = 883 in /etc/iggy-edge/config.toml, then systemctl restart mosquitto iggy-edge"
)


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
            worst = worse(worst, "warn")
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
        status = worse(status, st)
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
        status = worse(status, "warn")
        fix = fix or AGENT_LISTENER_FIX
    return Check("broker-listener", status, "; ".join(notes), fix)
