"""sd_notify over a real unix datagram socket; JSON logs; no secret in any log line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from iggy_edge import __version__
from iggy_edge.logs import (
    REDACTED,
    JsonFormatter,
    Redactor,
    install_loop_exception_handler,
    priority,
    setup_logging,
)
from iggy_edge.runtime import build_agent
from iggy_edge.stages import Health
from iggy_edge.systemd import Notifier, systemd_notify

from tests.support.agent import make_settings
from tests.support.auth_broker import password_broker
from tests.support.broker import Broker
from tests.support.ports import free_port
from tests.support.wait import wait_until


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def _fake_agent() -> Any:
    return SimpleNamespace(
        ready=asyncio.Event(),
        backlog_records=7,
        health=lambda: Health(True, "up", "ok", "up"),
    )


async def _recv(sock: socket.socket, timeout: float = 5.0) -> str:
    loop = asyncio.get_running_loop()
    data = await asyncio.wait_for(loop.sock_recv(sock, 4096), timeout)
    return data.decode()


async def test_ready_only_once_the_stages_are_up_then_watchdog_then_stopping(
    tmp_path: Path, notify_socket: socket.socket, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real agent (built like `iggy-edge run` builds it) under a fake
    systemd: READY=1 is the first message, and what it reports was true when
    it was sent -- buffer open, MQTT session up -- so a READY sent before the
    stages were up would fail here (it would say "ingest down")."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    settings = make_settings(tmp_path, broker, metrics={"enabled": False})
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    try:
        first = await _recv(notify_socket, timeout=20)
        assert first.splitlines()[0] == "READY=1"
        assert "STATUS=ingest up, store ok, uplink none, backlog 0 records" in first
        assert agent.ready.is_set()
        assert agent.health().ingest == "up"
        pings = [await _recv(notify_socket) for _ in range(3)]
        assert all(p.startswith("WATCHDOG=1\n") for p in pings)
    finally:
        agent.stop()
        await asyncio.wait_for(task, 15)
    rest: list[str] = []
    while not rest or rest[-1] != "STOPPING=1":
        rest.append(await _recv(notify_socket))
    assert all(r.startswith("WATCHDOG=1\n") for r in rest[:-1])


async def test_ready_comes_within_the_bound_when_the_broker_is_away(
    tmp_path: Path, notify_socket: socket.socket
) -> None:
    """No broker at boot: READY=1 still comes (systemd must not kill an agent
    that drains its backlog), after the bound, and says ingest is down."""
    settings = make_settings(tmp_path, mqtt={"port": free_port()}, metrics={"enabled": False})
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    notify = asyncio.create_task(systemd_notify(agent, notifier, ready_wait_s=0.5))
    try:
        ready = await _recv(notify_socket)
        assert ready.splitlines()[0] == "READY=1"
        assert "STATUS=ingest down, store ok" in ready
        assert agent.ready.is_set()
    finally:
        notify.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await notify
        agent.stop()
        await asyncio.wait_for(task, 15)


async def test_abstract_socket_address(notify_socket: socket.socket) -> None:
    name = f"iggy-edge-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract.bind("\0" + name)
    abstract.setblocking(False)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).notify("READY=1")
        assert await _recv(abstract) == "READY=1"
    finally:
        abstract.close()


async def test_no_notify_socket_is_a_no_op() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.notify("READY=1") is False
    # the component returns at once instead of waiting for readiness
    await asyncio.wait_for(systemd_notify(_fake_agent(), n), 1)


def test_watchdog_for_another_pid_is_ignored(tmp_path: Path) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "x"), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None


def test_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).notify("READY=1") is False


# -- logs ----------------------------------------------------------------------


def _record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("iggy_edge.test", logging.ERROR, __file__, 1, msg, args, exc_info)


def test_json_format_is_one_object_per_line() -> None:
    line = JsonFormatter().format(_record("uplink %s down for %ds", "iggy", 30, exc=True))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["msg"] == "uplink iggy down for 30s"
    assert doc["level"] == "ERROR"
    assert doc["logger"] == "iggy_edge.test"
    assert doc["ts"].endswith("+00:00")
    assert "ValueError: boom" in doc["exc"]


def test_redactor_removes_secret_from_message_args_and_traceback() -> None:
    red = Redactor(["hunter2-secret", "ab"])  # short values only where secrets stand
    rec = _record("connect to iggy+tcp://u:%s@host failed", "hunter2-secret")
    assert red.filter(rec)
    assert "hunter2-secret" not in rec.getMessage()
    assert REDACTED in rec.getMessage()
    try:
        raise RuntimeError("login failed for password hunter2-secret")
    except RuntimeError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "oops", None, sys.exc_info())
    red.filter(rec)
    assert "hunter2-secret" not in JsonFormatter().format(rec)
    assert "login failed for password" in JsonFormatter().format(rec)


def test_redaction_where_secrets_stand_not_everywhere() -> None:
    """A short password equal to the user name is redacted in the URL and after
    `password=`, and every other mention of the user stays readable."""
    red = Redactor(["agent"], public=["agent", "gw-1"])
    rec = _record(
        "user agent: connect to mqtt://agent:agent@127.0.0.1:1883 failed (password=agent); agent retries"
    )
    red.filter(rec)
    assert rec.getMessage() == (
        f"user agent: connect to mqtt://agent:{REDACTED}@127.0.0.1:1883 failed "
        f"(password={REDACTED}); agent retries"
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("iggy+tcp://u:p4ss@host:8090?tls=true", f"iggy+tcp://u:{REDACTED}@host:8090?tls=true"),
        ('{"password": "a b c", "user": "u"}', f'{{"password": "{REDACTED}", "user": "u"}}'),
        ("{'mqtt_password': 'x', 'host': 'h'}", f"{{'mqtt_password': '{REDACTED}', 'host': 'h'}}"),
        ("token: abc123, next", f"token: {REDACTED}, next"),
        ("IGGY_PASSWORD=xyz other=1", f"IGGY_PASSWORD={REDACTED} other=1"),
        ("api-key = k&x=1", f"api-key = {REDACTED}&x=1"),
        # no secret stands here: nothing is touched
        ("2 tokens left, http://host/a:b@c, password reset by operator", None),
        ("the secret sauce", None),
    ],
)
def test_redaction_patterns(line: str, expected: str | None) -> None:
    rec = _record(line.replace("%", "%%"))
    Redactor().filter(rec)
    assert rec.getMessage() == (line if expected is None else expected)


def test_long_secret_is_redacted_anywhere_but_not_when_it_is_public() -> None:
    red = Redactor(["Vai9e-long-secret", "gw-plant-7"], public=["gw-plant-7"])
    rec = _record("echoed Vai9e-long-secret by a library; gateway gw-plant-7")
    red.filter(rec)
    assert rec.getMessage() == f"echoed {REDACTED} by a library; gateway gw-plant-7"


async def test_loop_exception_handler_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio's error reports (e.g. accept() out of descriptors) are logged once
    per kind and interval, with the traceback, not once each."""
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()
    install_loop_exception_handler(loop, interval=60)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(1000):
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": OSError(24, "EMFILE")}
                )
            loop.call_exception_handler({"message": "another kind"})
    finally:
        loop.set_exception_handler(old)
    records = [r for r in caplog.records if r.name == "asyncio"]
    assert [r.getMessage() for r in records] == ["socket.accept() out of system resource", "another kind"]
    assert records[0].exc_info is not None


def test_setup_logging_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown log format"):
        setup_logging("INFO", "xml")
    setup_logging("WARNING", "text")  # restore something sane for later tests


@pytest.mark.slow
def test_agent_never_logs_its_passwords(tmp_path: Path) -> None:
    """Run the real `iggy-edge run` with both passwords set, at DEBUG, against a
    broker that needs a password and an Iggy address where nothing listens (so
    connection errors are logged over and over), then grep everything it wrote."""
    mqtt_secret = "mqtt-s3cret-Ohm4u"
    iggy_secret = "iggy-s3cret-Vai9e"
    binary = Path(sys.executable).parent / "iggy-edge"
    with password_broker(tmp_path / "broker", {"agent": mqtt_secret}) as broker:
        config = tmp_path / "config.toml"
        config.write_text(
            f'gateway_id = "gw-secret"\nstate_dir = "{tmp_path / "state"}"\n'
            f'[mqtt]\nhost = "127.0.0.1"\nport = {broker.port}\nusername = "agent"\n'
            f'[iggy]\nkind = "iggy"\naddress = "127.0.0.1:{free_port()}"\nconnect_timeout_s = 0.5\n'
            f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
            '[logging]\nlevel = "DEBUG"\nformat = "json"\n'
        )
        env = dict(os.environ, IGGY_EDGE_MQTT_PASSWORD=mqtt_secret, IGGY_PASSWORD=iggy_secret)
        log_path = tmp_path / "agent.log"
        with log_path.open("wb") as log_file:
            agent = subprocess.Popen(
                [str(binary), "run", "-c", str(config)], stdout=log_file, stderr=subprocess.STDOUT, env=env
            )
            try:
                wait_until(lambda: b"MQTT session up" in log_path.read_bytes(), 20, what="MQTT session up")
                wait_until(
                    lambda: b"uplink unavailable" in log_path.read_bytes(), 20, what="uplink error logged"
                )
                agent.send_signal(signal.SIGTERM)
                assert agent.wait(20) == 0
            finally:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
        out = log_path.read_text()
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) >= 3
        for line in lines:
            json.loads(line)  # one JSON event per line, nothing else
        assert mqtt_secret not in out
        assert iggy_secret not in out
        assert '"stopped;' in out


def _run_agent_until(tmp_path: Path, env: dict[str, str], wanted: bytes, *, journal: bool) -> str:
    """`iggy-edge run` with no broker to reach, stderr into a file; when
    `journal`, JOURNAL_STREAM names that file as systemd names the journal's
    stream.  Stopped with SIGTERM once `wanted` was written."""
    binary = Path(sys.executable).parent / "iggy-edge"
    config = tmp_path / "config.toml"
    config.write_text(
        f'gateway_id = "gw-journal"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        f"[metrics]\nenabled = false\n"
    )
    log_path = tmp_path / ("journal.log" if journal else "plain.log")
    with log_path.open("wb") as log_file:
        st = os.fstat(log_file.fileno())
        if journal:
            env = dict(env, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        agent = subprocess.Popen(
            [str(binary), "run", "-c", str(config)], stdout=log_file, stderr=subprocess.STDOUT, env=env
        )
        try:
            wait_until(lambda: wanted in log_path.read_bytes(), 20, what=wanted.decode())
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(20) == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return log_path.read_text()


@pytest.mark.slow
def test_under_journald_lines_carry_their_priority_and_no_second_timestamp(tmp_path: Path) -> None:
    """`journalctl -p warning` filters on the <N> prefix journald strips;
    the journal stamps each entry, so a text line has no time of its own.
    A JOURNAL_STREAM that is not our stderr (a shell started from a unit)
    changes nothing.  The start-up line names the version."""
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    out = _run_agent_until(tmp_path, env, b"WARNING", journal=True)
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[0].startswith(f"<6>INFO iggy_edge: iggy-edge {__version__} starting: gateway gw-journal")
    assert all(re.match(r"<[2-7]>[A-Z]+ ", line) for line in lines), lines
    warnings = [line for line in lines if " WARNING " in f" {line[3:]}"]
    assert warnings, lines
    assert all(line.startswith("<4>WARNING ") for line in warnings)
    assert not any(re.search(r"\d\d:\d\d:\d\d", line) for line in lines), lines

    other = dict(env, JOURNAL_STREAM="1:2")  # someone else's stream
    out = _run_agent_until(tmp_path, other, b"WARNING", journal=False)
    first = out.splitlines()[0]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO iggy_edge: iggy-edge ", first), first


def test_priorities_follow_syslog() -> None:
    assert [priority(n) for n in (10, 20, 25, 30, 40, 50, 60)] == [7, 6, 4, 4, 3, 2, 2]
