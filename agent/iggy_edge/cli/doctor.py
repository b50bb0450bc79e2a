"""`iggy-edge doctor`: check everything the agent depends on and say what to fix.

Checks, each bounded in time and independent of the others:

* config      the file parses and validates (with the service's secrets from
              /etc/iggy-edge/env when readable, as systemd would pass them)
* clock       the system time is plausible (a Pi without RTC boots in 1970
              until NTP syncs; message times and TTLs depend on it) and NTP
              synchronisation where systemd-timesyncd reports it
* disk        the buffer's file system has room for buffer.max_bytes
* broker      TCP reachability, then an MQTT CONNECT with the configured
              credentials under a separate client id (never the agent's: that
              would take over its persistent session)
* broker-listener, device-users, iggy-transport
              who holds the agent's listener, the names in the devices'
              password files, the Iggy password in clear (doctor_trust.py)
* iggy        reachability of every node (``iggy nodes`` when several are
              configured), login, the cluster's leader as the server tells
              it (``iggy cluster``), the topics the routes need and the
              user's permissions to send / create / poll (kind = "iggy" only)
* agent       whether a running agent answers on its health endpoint

Exit status 0 when nothing failed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Final

import gmqtt
import typer
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MQTTConnectError

from ..buffer_admin import read_stats
from ..config import ConfigError, IggySettings, Settings, load_config
from ..downlink.commands import commands_topic, config_topic
from ..gmqtt_hooks import own_reconnect, refusal_code
from ..httpd import local_url
from ..mqttconn import close
from ..store import ROW_OVERHEAD, StoreError
from ..timeouts import wait_for
from ..uplink.iggy import IggyProbe
from ..uplink.iggy.errors import IGGY_SDK_VERSION, IncompatibleServer
from ..uplink.protocol import UplinkError
from .common import DEFAULT_CONFIG, ConfigOption
from .doctor_trust import check_agent_listener, check_device_users, check_iggy_transport
from .doctor_types import MOSQUITTO_CONF_HINT, Check, Status, not_local_broker, summary

DEFAULT_ENV_FILE: Final = Path("/etc/iggy-edge/env")
TIMEOUT_S: Final = 5.0
MIN_YEAR: Final = 2024
# SQLite's file is larger than the accounted bytes (pages, indexes): measured
# file / accounted after a checkpoint, buffer filled to max_bytes, payloads
# 16 B .. 64 KiB: 0.74 .. 1.32 (worst near 1 KiB payloads: rows per page).
# A larger ratio measured on the actual file wins.
DISK_FACTOR: Final = 1.4
# Beside the file, the WAL: it grows to the largest transaction (a group
# commit: up to commit_max_records / receive_maximum records) on top of the
# auto-checkpoint threshold (1000 pages), and keeps its size.  Measured peak
# file + WAL / accounted with 500-record groups: 1.10 (8 KiB payloads) to 2.03
# (64 KiB payloads, 30 MB max_bytes).
WAL_CHECKPOINT_BYTES: Final = 1000 * 4096
TYPICAL_RECORD_BYTES: Final = 1024  # assumed when the buffer has too few records to measure
BAD_CREDENTIALS: Final = {4, 5, 0x86, 0x87}  # MQTT 3.1.1 and 5 refusal codes
MOSQUITTO_CONF: Final = Path("/etc/mosquitto/mosquitto.conf")
# What the agent's persistent session needs queued while the agent is stopped
# (the shipped snippet sets 1000000; Mosquitto's default 1000 drops the rest).
MIN_QUEUED_MESSAGES: Final = 100_000
MARK: Final = {"ok": "✓", "warn": "!", "fail": "✗", "skip": "-"}
COLOUR: Final = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "white"}


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines as systemd's EnvironmentFile= reads them (comments,
    blank lines, optional quotes)."""
    env: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, value = line.split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[key.strip()] = value
    return env


# -- individual checks ---------------------------------------------------------


def check_config(path: Path, env: Mapping[str, str]) -> tuple[Check, Settings | None]:
    try:
        settings = load_config(path, env=env)
    except ConfigError as e:
        lines = "; ".join(f"{k}: {m}" for k, m in e.problems)
        return Check(
            "config", "fail", f"{e.source}: {lines}", f"edit {path}, then: iggy-edge config check {path}"
        ), None
    where = settings.iggy.where if settings.iggy.kind == "iggy" else settings.iggy.kind
    return Check("config", "ok", f"{path}: gateway {settings.gateway_id}, uplink {where}"), settings


def check_clock(now: float | None = None) -> Check:
    now = time.time() if now is None else now
    year = time.gmtime(now).tm_year
    if year < MIN_YEAR:
        return Check(
            "clock",
            "fail",
            f"system time is {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(now))}",
            "the clock is not set (no RTC?): enable NTP (timedatectl set-ntp true) and check network access "
            "to the NTP servers; receive times and TTLs depend on it",
        )
    stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(now))
    synced = Path("/run/systemd/timesync/synchronized")
    if Path("/run/systemd/timesync").is_dir() and not synced.exists():
        return Check(
            "clock",
            "warn",
            f"{stamp}, but systemd-timesyncd has not synchronised yet",
            "check: timedatectl timesync-status",
        )
    return Check("clock", "ok", stamp + (" (NTP synchronised)" if synced.exists() else ""))


def check_disk(settings: Settings) -> Check:
    path = settings.buffer_path
    probe = path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return Check(
            "disk", "fail", f"cannot inspect {probe}: {e}", "check the buffer path (buffer.path / state_dir)"
        )
    free = st.f_bavail * st.f_frsize
    factor, record, measured = DISK_FACTOR, TYPICAL_RECORD_BYTES, "assuming 1 KiB records"
    try:
        stats = read_stats(path) if path.exists() else None
    except StoreError:
        stats = None
    current = stats.file_bytes if stats is not None else path.stat().st_size if path.exists() else 0
    if stats is not None and stats.records >= 1000:
        record = stats.bytes // stats.records
        factor = max(DISK_FACTOR, stats.file_bytes / stats.bytes)
        measured = f"measured on the file: {factor:.2f} x accounted, {record} B per record"
    group = min(settings.buffer.commit_max_records, settings.mqtt.receive_maximum)
    # a group larger than the whole bound is trimmed to it
    wal = WAL_CHECKPOINT_BYTES + int(min(group * record, settings.buffer.max_bytes) * DISK_FACTOR)
    max_bytes = settings.buffer.max_bytes
    # dead letters have their own bound beside max_bytes (store/dead.py)
    dead_bytes = settings.buffer.max_dead_letter_bytes
    need = int((max_bytes + dead_bytes) * factor) + wal - current
    detail = (
        f"{probe}: {free / 1e6:,.0f} MB free; buffer.max_bytes {max_bytes / 1e6:,.0f} MB "
        f"+ buffer.max_dead_letter_bytes {dead_bytes / 1e6:,.0f} MB "
        f"needs about {max(need, 0) / 1e6:,.0f} MB more ({measured}; WAL {wal / 1e6:,.0f} MB)"
    )
    if free < max(need, 0):
        fit = int((free + current - wal) / factor) - ROW_OVERHEAD - dead_bytes
        return Check(
            "disk",
            "fail",
            detail,
            f"free space on {probe}, or lower buffer.max_bytes to at most {max(fit, 0):,} "
            "(the buffer would fill the disk before its bound applies)",
        )
    if not os.access(probe, os.W_OK):
        return Check(
            "disk",
            "warn",
            detail + f"; {probe} is not writable by this user",
            "run doctor as root or the service user",
        )
    return Check("disk", "ok", detail)


def _tcp(host: str, port: int, timeout: float) -> str | None:
    """None when something accepts a TCP connection, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:.0f}s"
    except OSError as e:
        return e.strerror or str(e)


async def check_broker(settings: Settings, timeout: float = TIMEOUT_S) -> Check:
    m = settings.mqtt
    where = f"{m.host}:{m.port}"
    problem = await asyncio.to_thread(_tcp, m.host, m.port, timeout)
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


async def check_iggy(settings: Settings, timeout: float = TIMEOUT_S) -> list[Check]:
    s = settings.iggy
    if s.kind != "iggy":
        note = {
            "none": "no uplink configured: records stay in the local buffer",
            "file": f"records go to the file {s.file_path} (debugging)",
            "memory": "in-memory uplink (tests only)",
        }[s.kind]
        status: Status = "warn" if s.kind in ("none", "memory") else "skip"
        return [
            Check(
                "iggy",
                status,
                f"kind = {s.kind!r}: {note}",
                'set [iggy] kind = "iggy" and address' if status == "warn" else "",
            )
        ]
    checks, reachable = await _iggy_nodes(s, timeout)
    if not reachable:
        return checks
    # Log in through the first reachable node (the probe moves on by itself
    # when one fails, as the agent does).
    s = s.model_copy(update={"addresses": tuple(reachable)})
    probe = IggyProbe(s, timeout_s=timeout)
    try:
        try:
            await probe.login()
        except UplinkError as e:
            text = str(e).lower()
            if isinstance(e, IncompatibleServer):
                fix = (
                    f"run iggy-server 0.9.x for this agent (apache-iggy {IGGY_SDK_VERSION}), "
                    "or an iggy-edge release made for that server"
                )
            elif "credential" in text or "unauthenticated" in text or "invalid" in text or "password" in text:
                fix = (
                    f"check iggy.username ({s.username!r}) and IGGY_PASSWORD in {DEFAULT_ENV_FILE} "
                    "(or the credentials_file)"
                )
            elif s.tls:
                fix = "check iggy.tls_ca_file / tls_domain against the server's certificate"
            else:
                fix = "is it an Iggy TCP endpoint (default port 8090)? does the server need TLS (IGGY_TLS)?"
            said = f"login to {s.where} as {s.username!r} failed: {e}"
            if s.password is None and not isinstance(e, IncompatibleServer):
                said = (
                    f"login to {s.where} as {s.username!r} failed: no password is set (the server said: {e})"
                )
                fix = (
                    f"set IGGY_PASSWORD in {DEFAULT_ENV_FILE} (or [iggy] password in the credentials_file); "
                    "never in the main config file"
                )
            return [*checks, Check("iggy", "fail", said, fix)]
        checks.append(Check("iggy", "ok", f"{probe.node}: logged in as {s.username!r}"))
        if len(settings.iggy.nodes) > 1:
            checks.append(await _iggy_leader(probe))
        checks.append(await _iggy_permissions(settings, probe))
        return checks
    finally:
        await probe.close()


async def _iggy_nodes(s: IggySettings, timeout: float) -> tuple[list[Check], list[str]]:
    """A TCP connect to every configured node (at once): the reachable ones,
    and a check saying which are (only when some are not, or several are
    configured)."""

    async def reach(address: str) -> str | None:
        host, _, port = address.rpartition(":")
        return await asyncio.to_thread(_tcp, host, int(port), timeout)

    problems = await asyncio.gather(*(reach(a) for a in s.nodes))
    reachable = [a for a, p in zip(s.nodes, problems, strict=True) if p is None]
    down = [f"{a} ({p})" for a, p in zip(s.nodes, problems, strict=True) if p is not None]
    fix = (
        "check iggy.address / iggy.addresses (IGGY_ADDRESS), the server, DNS and the firewall; the agent "
        "keeps buffering meanwhile"
    )
    if not reachable:
        return [Check("iggy", "fail", f"cannot reach {'; '.join(down)}", fix)], []
    if len(s.nodes) == 1:
        return [], reachable
    detail = f"{len(reachable)} of {len(s.nodes)} reachable: {', '.join(reachable)}"
    if down:
        return [Check("iggy nodes", "warn", f"{detail}; unreachable: {'; '.join(down)}", fix)], reachable
    return [Check("iggy nodes", "ok", detail)], reachable


async def _iggy_leader(probe: IggyProbe) -> Check:
    """Which node leads, as the node we logged in to tells it."""
    try:
        meta = await probe.cluster()
    except UplinkError as e:
        return Check("iggy cluster", "skip", f"the server does not tell its cluster's leader: {e}")
    leader = meta.leader
    nodes = ", ".join(f"{n.name} {n.address} {n.role} {n.status}" for n in meta.nodes)
    if leader is None:
        return Check(
            "iggy cluster",
            "warn",
            f"cluster {meta.name!r} names no leader (an election under way?): {nodes}",
            "run doctor again in a few seconds; if it persists, check the cluster's logs",
        )
    return Check(
        "iggy cluster", "ok", f"cluster {meta.name!r}, leader {leader.name} ({leader.address}); {nodes}"
    )


async def _iggy_permissions(settings: Settings, probe: IggyProbe) -> Check:
    """Which streams/topics exist, and whether the user may send, create and poll."""
    s = settings.iggy
    send_to = sorted({(r.stream, r.topic) for r in settings.routes})
    poll_from: list[tuple[str, str]] = []
    if settings.downlink.enabled:
        # the agent's own names for them, so doctor cannot drift from it
        d = settings.downlink
        poll_from = [(d.stream, commands_topic(settings)), (d.stream, config_topic(settings))]
    missing: list[str] = []
    try:
        for stream, topic in send_to + poll_from:
            if await probe.topic(stream, topic) is None:
                missing.append(f"{stream}/{topic}")
        user = await probe.user(s.username)
    except UplinkError as e:
        return Check(
            "iggy permissions",
            "fail",
            f"cannot read streams/topics: {e}",
            f"grant {s.username!r} read_streams/read_topics, send_messages on the route streams and "
            "poll_messages on the downlink stream",
        )
    if missing and not s.create_missing:
        return Check(
            "iggy permissions",
            "fail",
            f"missing topics: {', '.join(missing)} and iggy.create_missing is off",
            f"create {', '.join(missing)} on the server (iggy topic create <stream> <topic> ...), "
            "or set iggy.create_missing = true",
        )
    perms = None if user is None else user.permissions
    if perms is None:
        note = "user has no explicit permission set (root?)" if user is not None else "cannot read own user"
        return Check(
            "iggy permissions",
            "warn" if user is None else "ok",
            note + (f"; will create {', '.join(missing)}" if missing else ""),
            "" if user is not None else f"give {s.username!r} read_users to let doctor verify permissions",
        )
    g = perms.global_permissions
    streams = perms.streams or {}
    needs: list[str] = []

    async def stream_perm(stream: str) -> Any:
        details = await probe.stream(stream)
        return None if details is None else streams.get(details.id)

    for stream, _topic in send_to:
        sp = await stream_perm(stream)
        if not (
            g.send_messages or g.manage_streams or (sp is not None and (sp.send_messages or sp.manage_stream))
        ):
            needs.append(f"send_messages on stream {stream}")
    if missing and not (g.manage_streams or g.manage_topics):
        needs.append(f"manage_topics (or manage_streams) to create {', '.join(missing)}")
    for stream, _topic in poll_from:
        sp = await stream_perm(stream)
        if not (
            g.poll_messages or g.manage_streams or (sp is not None and (sp.poll_messages or sp.manage_stream))
        ):
            needs.append(f"poll_messages on stream {stream} (commands/config)")
    if needs:
        return Check(
            "iggy permissions",
            "fail",
            f"{s.username!r} lacks: " + "; ".join(needs),
            "grant them with the Iggy CLI or web UI (iggy user permissions ...)",
        )
    extra = f"; will create {', '.join(missing)}" if missing else ""
    return Check("iggy permissions", "ok", "may send to the route topics and poll commands" + extra)


def check_agent(settings: Settings, timeout: float = 2.0) -> Check:
    if not settings.metrics.enabled:
        return Check("agent", "skip", "metrics endpoint disabled (metrics.enabled = false)")
    url = local_url(settings.metrics.listen) + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout):  # noqa: S310 - http URL
            pass
        return Check("agent", "ok", f"running and healthy ({url})")
    except urllib.error.HTTPError as e:
        doc = json.loads(e.read() or b"{}")
        return Check(
            "agent",
            "warn",
            f"running but unhealthy: ingest {doc.get('ingest')}, store {doc.get('store')}, "
            f"uplink {doc.get('uplink')}",
            "see journalctl -u iggy-edge and iggy-edge status",
        )
    except (OSError, ValueError):
        return Check("agent", "skip", f"not running (nothing at {url})")


# -- command -------------------------------------------------------------------


async def run_checks(
    config: Path, env: Mapping[str, str], mosquitto_conf: Path = MOSQUITTO_CONF
) -> list[Check]:
    cfg, settings = check_config(config, env)
    checks = [cfg, check_clock()]
    if settings is None:
        checks.append(Check("broker", "skip", "needs a valid config"))
        checks.append(Check("iggy", "skip", "needs a valid config"))
        return checks
    checks.append(check_disk(settings))
    broker, iggy = await asyncio.gather(check_broker(settings), check_iggy(settings))
    checks.append(broker)
    checks.append(check_broker_config(settings, mosquitto_conf))
    checks.append(await asyncio.to_thread(check_agent_listener, settings))
    checks.append(check_device_users(settings, mosquitto_conf))
    checks.extend(iggy)
    transport = check_iggy_transport(settings)
    if transport is not None:
        checks.append(transport)
    checks.append(await asyncio.to_thread(check_agent, settings))
    return checks


def doctor(
    config: ConfigOption = DEFAULT_CONFIG,
    env_file: Annotated[
        Path,
        typer.Option(help="Secrets file the service reads (EnvironmentFile=); used when readable."),
    ] = DEFAULT_ENV_FILE,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable results.")] = False,
    mosquitto_conf: Annotated[
        Path, typer.Option(help="The local broker's config, read when mqtt.host is this machine.")
    ] = MOSQUITTO_CONF,
) -> None:
    """Check config, clock, disk, broker and its config, Iggy and permissions; print what to fix."""
    logging.getLogger("gmqtt").setLevel(logging.CRITICAL)  # its refusal warnings duplicate ours
    env = dict(os.environ)
    env_note: Check | None = None
    if env_file.exists():
        try:
            env = read_env_file(env_file) | env  # the caller's environment wins, as an override
        except PermissionError:
            env_note = Check(
                "secrets",
                "warn",
                f"{env_file} is not readable by this user",
                "run doctor with sudo to check with the service's credentials",
            )
        except (OSError, UnicodeDecodeError) as e:
            env_note = Check(
                "secrets", "fail", f"cannot read {env_file}: {e}", "fix the file (KEY=value lines)"
            )
    checks = asyncio.run(run_checks(config, env, mosquitto_conf))
    if env_note is not None:
        checks.insert(1, env_note)
    failed = [c for c in checks if c.status == "fail"]
    if as_json:
        typer.echo(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            typer.secho(f"{MARK[c.status]} {c.name}: {c.detail}", fg=COLOUR[c.status])
            if c.fix and c.status in ("fail", "warn"):
                typer.echo(f"    fix: {c.fix}")
        typer.echo("\n" + summary(checks))
    if failed:
        raise typer.Exit(1)
