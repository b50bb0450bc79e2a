"""Doctor's checks of the MQTT broker the agent uses:

* broker         TCP reachability, then an MQTT CONNECT with the configured
                 credentials under a separate client id (never the agent's:
                 that would take over its persistent session)
* broker-config  the local Mosquitto keeps what is queued for the agent's
                 session (docs/operations.md, Mosquitto)
* device-users   every name in the devices' password files is a device id
                 (device_ids: no '/', '+', '#', not reserved for the agent),
                 and the devices' listeners do not share the agent's ACL file
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MQTTConnectError

from .checks import (
    DEFAULT_ENV_FILE,
    MOSQUITTO_CONF_HINT,
    TIMEOUT_S,
    Check,
    not_local_broker,
    tcp_problem,
)
from .config import Settings
from .device_ids import device_id_problem
from .gmqtt_hooks import own_reconnect, refusal_code
from .mqttconn import close
from .timeouts import wait_for

BAD_CREDENTIALS: Final = {4, 5, 0x86, 0x87}  # MQTT 3.1.1 and 5 refusal codes
MOSQUITTO_CONF: Final = Path("/etc/mosquitto/mosquitto.conf")
# What the agent's persistent session needs queued while the agent is stopped
# (the shipped snippet sets 1000000; Mosquitto's default 1000 drops the rest).
MIN_QUEUED_MESSAGES: Final = 100_000


async def check_broker(settings: Settings, timeout: float = TIMEOUT_S) -> Check:
    m = settings.mqtt
    where = f"{m.host}:{m.port}"
    problem = await asyncio.to_thread(tcp_problem, m.host, m.port, timeout)
    if problem is not None:
        return Check(
            "broker",
            "fail",
            f"cannot reach {where}: {problem}",
            "start the broker (systemctl status mosquitto) or fix mqtt.host / mqtt.port "
            "(or IGGY_EDGE_MQTT_HOST / _PORT); check the firewall",
        )
    client = gmqtt.Client(f"{settings.mqtt_client_id}-doctor", clean_session=True)
    own_reconnect(client, _no_reconnect)
    if m.username:
        client.set_auth_credentials(m.username, m.password.get_secret_value() if m.password else None)
    ctx: ssl.SSLContext | bool = False
    if m.tls:
        ctx = ssl.create_default_context(cafile=str(m.tls_ca_file) if m.tls_ca_file else None)
    who = f"as {m.username!r}" if m.username else "anonymously"
    try:
        await wait_for(client.connect(m.host, m.port, ssl=ctx, version=MQTTv50, keepalive=30), timeout)
    except MQTTConnectError as e:
        code = refusal_code(e)
        if code in BAD_CREDENTIALS:
            if m.username and m.password is None:
                return Check(
                    "broker",
                    "fail",
                    f"{where} refused the login {who}: no password is set (the broker said: {e})",
                    f"set IGGY_EDGE_MQTT_PASSWORD in {DEFAULT_ENV_FILE} (or [mqtt] password in the "
                    "credentials_file), matching the broker's password file",
                )
            return Check(
                "broker",
                "fail",
                f"{where} refused the login {who}: {e}",
                "wrong or missing credentials: set mqtt.username and IGGY_EDGE_MQTT_PASSWORD in "
                f"{DEFAULT_ENV_FILE}, matching the broker's password file "
                "(mosquitto_passwd /etc/mosquitto/iggy-edge.passwd <user>)",
            )
        return Check("broker", "fail", f"{where} refused the connection: {e}", "see the broker's log")
    except (TimeoutError, OSError, ssl.SSLError) as e:
        return Check(
            "broker",
            "fail",
            f"{where} accepts TCP but no MQTT session {who}: {type(e).__name__} {e}",
            "is it an MQTT broker, and does mqtt.tls match the listener?",
        )
    finally:
        await _quiet_disconnect(client)
    return Check("broker", "ok", f"{where}: MQTT 5 session {who} works")


def mosquitto_settings(conf: Path) -> dict[str, str]:
    """The global options of a Mosquitto config and the `.conf` files of its
    `include_dir`s (alphabetical, as Mosquitto reads them); a later line wins.
    Raises OSError when a file cannot be read."""
    values: dict[str, str] = {}
    files, seen = [conf], set()
    while files:
        path = files.pop(0)
        if path.resolve() in seen:
            continue  # an include_dir that includes itself
        seen.add(path.resolve())
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.strip().partition(" ")
            if not key or key.startswith("#"):
                continue
            if key == "include_dir":
                files.extend(sorted(Path(value.strip()).glob("*.conf")))
            else:
                values[key] = value.strip()
    return values


def check_broker_config(settings: Settings, conf: Path = MOSQUITTO_CONF) -> Check:
    """The local Mosquitto's options that decide whether the agent's session
    keeps what is queued for it (docs/operations.md, Mosquitto)."""
    if (skip := not_local_broker("broker-config", settings, conf)) is not None:
        return skip
    try:
        values = mosquitto_settings(conf)
    except OSError as e:
        return Check("broker-config", "skip", f"cannot read the broker's config: {e}", "run doctor with sudo")
    problems, fixes = [], []
    if values.get("queue_qos0_messages", "false").lower() == "true":
        problems.append(
            "queue_qos0_messages true: after the agent was stopped, more queued QoS0 messages than its"
            f" receive maximum ({settings.mqtt.receive_maximum}) keep Mosquitto 2.0.11 from sending it"
            " any QoS1 message until it reconnects"
        )
        fixes.append("remove queue_qos0_messages (devices that must not lose a reading publish QoS 1)")
    try:
        queued = int(values.get("max_queued_messages", "1000"))
    except ValueError:
        queued = 1000
    if 0 < queued < MIN_QUEUED_MESSAGES:
        problems.append(
            f"max_queued_messages {queued}: the broker drops what is queued for the agent beyond that"
            " while the agent is stopped"
        )
        fixes.append("install packaging/mosquitto/iggy-edge.conf in /etc/mosquitto/conf.d (1000000)")
    if problems:
        return Check(
            "broker-config",
            "warn",
            f"read {conf} ({MOSQUITTO_CONF_HINT}): " + "; ".join(problems),
            "; ".join(fixes),
        )
    return Check(
        "broker-config",
        "ok",
        f"read {conf} ({MOSQUITTO_CONF_HINT}): queue depth {queued or 'unlimited'}, QoS0 not queued",
    )


def _no_reconnect() -> None:
    """gmqtt would reconnect on its own after a refusal; doctor asks once."""


async def _quiet_disconnect(client: gmqtt.Client) -> None:
    # Not only when connected: a connect that got no CONNACK holds its socket.
    await close(client, 2)


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
