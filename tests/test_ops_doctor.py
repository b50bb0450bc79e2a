"""`iggy-edge doctor` against real brokers (reachable, unreachable, wrong
credentials), a full disk (a 1 MiB tmpfs) and a bad clock, with the advice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.broker_checks import check_broker_config
from iggy_edge.cli.main import app
from iggy_edge.clock_check import check_clock
from iggy_edge.config import load_config, parse_config
from iggy_edge.config_check import read_env_file
from iggy_edge.downlink.commands import return_topic
from iggy_edge.uplink.iggy import IggyUplink
from typer.testing import CliRunner

from tests.support.auth_broker import password_broker
from tests.support.broker import Broker
from tests.support.ports import free_port
from tests.support.tmpfs import small_tmpfs
from tests.support.vsr_fake import VsrFake, vsr_fake_in_thread

runner = CliRunner()


def write_config(tmp_path: Path, *, port: int, state_dir: Path | None = None, extra: str = "") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'gateway_id = "gw-doc"\nstate_dir = "{state_dir or tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "127.0.0.1"\nport = {port}\n'
        f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n' + extra
    )
    return path


def doctor(config: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    """Run doctor twice: --json for the assertions, text for the advice."""
    argv = ["doctor", "-c", str(config), "--env-file", str(config.parent / "no-env")]
    argv += ["--mosquitto-conf", str(config.parent / "no-mosquitto.conf"), *args]  # not this machine's
    as_json = runner.invoke(app, [*argv, "--json"], env=env)
    text = runner.invoke(app, argv, env=env)
    assert as_json.exit_code == text.exit_code
    doc = json.loads(as_json.stdout)
    return as_json.exit_code, {c["name"]: c for c in doc["checks"]}, text.stdout


def test_reachable_broker_passes(tmp_path: Path, broker: Broker) -> None:
    code, checks, text = doctor(write_config(tmp_path, port=broker.port))
    assert checks["broker"]["status"] == "ok", checks["broker"]
    assert "MQTT 5 session anonymously works" in checks["broker"]["detail"]
    assert checks["config"]["status"] == "ok"
    assert checks["clock"]["status"] in ("ok", "warn")
    assert checks["disk"]["status"] == "ok"
    assert checks["iggy"]["status"] == "warn"  # kind = none: nothing is forwarded
    assert checks["agent"]["status"] == "skip"
    assert code == 0
    assert "✓ broker" in text
    # iggy kind = none warns and no agent answers: not "all checks passed"
    assert "all checks passed" not in text
    warned = sum(c["status"] == "warn" for c in checks.values())  # the clock may warn too
    assert text.rstrip().endswith(
        f"passed with {warned} warning{'s' * (warned > 1)}; the agent is not running"
    )
    # which broker config it read, and how to name another
    assert "no-mosquitto.conf on this machine (name another with --mosquitto-conf PATH)" in text


@pytest.mark.unit
def test_unreachable_broker_fails_with_advice(tmp_path: Path) -> None:
    code, checks, text = doctor(write_config(tmp_path, port=free_port()))
    assert code == 1
    assert checks["broker"]["status"] == "fail"
    assert "Connection refused" in checks["broker"]["detail"]
    assert "✗ broker: cannot reach 127.0.0.1:" in text
    assert "fix: start the broker (systemctl status mosquitto)" in text


def test_wrong_and_right_credentials(tmp_path: Path) -> None:
    with password_broker(tmp_path / "auth", {"iggy-edge": "right-password"}) as broker:
        config = write_config(tmp_path, port=broker.port, extra="")
        text = config.read_text().replace("[mqtt]\n", '[mqtt]\nusername = "iggy-edge"\n')
        config.write_text(text)

        code, checks, out = doctor(config, env={"IGGY_EDGE_MQTT_PASSWORD": "wrong-password"})
        assert code == 1
        assert checks["broker"]["status"] == "fail"
        assert "refused the login as 'iggy-edge'" in checks["broker"]["detail"]
        assert "wrong or missing credentials" in out
        assert "mosquitto_passwd" in out
        assert "wrong-password" not in out

        code, checks, out = doctor(config)  # no password at all
        assert checks["broker"]["status"] == "fail"
        assert "no password is set" in checks["broker"]["detail"]
        assert "set IGGY_EDGE_MQTT_PASSWORD in /etc/iggy-edge/env" in out
        warned = sum(c["status"] == "warn" for c in checks.values())
        assert out.rstrip().endswith(
            f"1 problem, {warned} warning{'s' * (warned > 1)}; the agent is not running"
        )

        # The right password from the service's env file (as systemd passes it).
        env_file = tmp_path / "env"
        env_file.write_text("# secrets\nIGGY_EDGE_MQTT_PASSWORD='right-password'\n")
        argv = ["doctor", "-c", str(config), "--env-file", str(env_file), "--json"]
        result = runner.invoke(app, argv)
        checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
        assert checks["broker"]["status"] == "ok", checks["broker"]
        assert result.exit_code == 0


# the disk tests' bound for dead letters (their own bound beside max_bytes)
DEAD_SMALL = "[buffer]\nmax_dead_letter_bytes = 100000\n"


def test_full_disk_says_what_fits(tmp_path: Path, broker: Broker) -> None:
    # 16 MiB: the WAL alone grows to ~4 MB (1000 pages) before SQLite checkpoints it
    with small_tmpfs(tmp_path / "small", "16m") as small:
        # Fill it: what remains is far below the buffer's bound.
        with contextlib.suppress(OSError):
            (small / "filler").write_bytes(b"\0" * (16 * 1024 * 1024))
        config = write_config(
            tmp_path, port=broker.port, state_dir=small / "state", extra=DEAD_SMALL + "max_bytes=104857600\n"
        )
        code, checks, out = doctor(config)
        assert code == 1
        assert checks["disk"]["status"] == "fail", checks["disk"]
        assert checks["broker"]["status"] == "ok"  # the other checks still ran
        assert "lower buffer.max_bytes to at most" in out
        assert f"free space on {small}" in out

        # With a bound that fits, the same disk passes.
        (small / "filler").unlink()
        config.write_text(config.read_text().replace("max_bytes=104857600", "max_bytes=102400"))
        code, checks, _ = doctor(config)
        assert checks["disk"]["status"] == "ok", checks["disk"]


def test_disk_check_counts_pages_and_the_wal_not_1_3(tmp_path: Path, broker: Broker) -> None:
    """11 MB of records does not fit a 16 MiB disk: the file takes up to 1.32x
    the accounted bytes (measured, 1 KiB payloads) and the WAL ~4 MB more on
    top of a group commit; the old 1.3 factor said 14.3 MB and passed it."""
    with small_tmpfs(tmp_path / "small", "16m") as small:
        config = write_config(
            tmp_path, port=broker.port, state_dir=small / "state", extra=DEAD_SMALL + "max_bytes = 11000000\n"
        )
        code, checks, out = doctor(config)
        assert code == 1
        assert checks["disk"]["status"] == "fail", checks["disk"]
        assert "WAL" in out
        config.write_text(config.read_text().replace("max_bytes = 11000000", "max_bytes = 6000000"))
        code, checks, _ = doctor(config)
        assert checks["disk"]["status"] == "ok", checks["disk"]


def test_disk_check_counts_the_dead_letter_bound(tmp_path: Path, broker: Broker) -> None:
    """Dead letters have their own bound beside max_bytes (issue 18 item 6):
    a max_bytes that fits alone fails once the dead-letter bound is added."""
    with small_tmpfs(tmp_path / "small", "16m") as small:
        config = write_config(
            tmp_path,
            port=broker.port,
            state_dir=small / "state",
            extra="[buffer]\nmax_bytes = 6000000\nmax_dead_letter_bytes = 100000\n",
        )
        _, checks, _ = doctor(config)
        assert checks["disk"]["status"] == "ok", checks["disk"]
        config.write_text(
            config.read_text().replace("max_dead_letter_bytes = 100000", "max_dead_letter_bytes = 20000000")
        )
        _, checks, _ = doctor(config)
        assert checks["disk"]["status"] == "fail", checks["disk"]
        assert "max_dead_letter_bytes" in checks["disk"]["detail"]


@pytest.mark.unit
def test_clock_before_2024_fails() -> None:
    bad = check_clock(now=0.0)
    assert bad.status == "fail"
    assert "1970-01-01" in bad.detail
    assert "timedatectl set-ntp true" in bad.fix
    assert check_clock(now=time.time()).status in ("ok", "warn")


@pytest.mark.unit
def test_invalid_config_fails_and_skips_the_rest(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('gateway_id = "bad id!"\n[mqtt]\nport = 99999\n')
    code, checks, out = doctor(config)
    assert code == 1
    assert checks["config"]["status"] == "fail"
    assert "gateway_id" in checks["config"]["detail"]
    assert "mqtt.port" in checks["config"]["detail"]
    assert checks["broker"]["status"] == "skip"
    assert "fix: edit" in out


@pytest.mark.unit
def test_env_file_parsing(tmp_path: Path) -> None:
    f = tmp_path / "env"
    f.write_text("# c\n\nA=1\nB=\"two words\"\n; other comment\nC='x=y'\nnot a pair\n")
    assert read_env_file(f) == {"A": "1", "B": "two words", "C": "x=y"}


@pytest.mark.iggy
def test_iggy_login_and_permissions(tmp_path: Path, broker: Broker, iggy_server: Any) -> None:
    extra = f'[iggy]\nkind = "iggy"\naddress = "{iggy_server.address}"\nusername = "{iggy_server.username}"\n'
    config = write_config(tmp_path, port=broker.port, extra=extra)
    code, checks, _ = doctor(config, env={"IGGY_PASSWORD": iggy_server.password})
    assert checks["iggy"]["status"] == "ok", checks["iggy"]
    assert checks["iggy permissions"]["status"] == "ok", checks["iggy permissions"]
    assert code == 0
    code, checks, out = doctor(config, env={"IGGY_PASSWORD": "not-the-password"})
    assert code == 1
    assert checks["iggy"]["status"] == "fail"
    assert "IGGY_PASSWORD" in out
    assert "no password is set" not in out
    code, checks, out = doctor(config, env={})  # none set: say so, not the server's "Invalid password"
    assert code == 1
    assert "no password is set" in checks["iggy"]["detail"]
    assert "fix: set IGGY_PASSWORD in /etc/iggy-edge/env" in out


@pytest.mark.iggy
def test_iggy_downlink_topics_are_the_agents(tmp_path: Path, broker: Broker, iggy_server: Any) -> None:
    """doctor asks for edge-rp-<n>/return.<gateway>, the topic the agent
    polls: no false "will create" once it exists, and with create_missing
    off the fix names the right one."""
    extra = (
        f'[iggy]\nkind = "iggy"\naddress = "{iggy_server.address}"\nusername = "{iggy_server.username}"\n'
        "create_missing = false\n"
    )
    config = write_config(tmp_path, port=broker.port, extra=extra)
    env = {"IGGY_PASSWORD": iggy_server.password}
    code, checks, _ = doctor(config, env=env)
    perms = checks["iggy permissions"]
    assert code == 1
    assert perms["status"] == "fail", perms
    missing = perms["detail"].split("missing topics: ")[1].split(" and ")[0].split(", ")
    settings = load_config(config, env=env)
    rt = return_topic(settings)
    assert f"{rt.stream}/return.gw-doc" in missing
    assert "edge/commands.gw-doc" not in missing
    assert perms["fix"].startswith("create edge/acks, ")
    assert f"{rt.stream}/return.gw-doc" in perms["fix"]
    # what provisioning creates (route topics and the return-path topic)
    wanted = [(r.stream, r.topic) for r in settings.routes]
    wanted += [(rt.stream, rt.topic)]
    made = settings.iggy.model_copy(update={"create_missing": True})

    async def create() -> None:
        uplink = IggyUplink(made, settings.gateway_id, topics=wanted)
        try:
            await uplink.start()
        finally:
            await uplink.close()

    asyncio.run(create())
    code, checks, _ = doctor(config, env=env)
    perms = checks["iggy permissions"]
    assert perms["status"] == "ok", perms
    assert "will create" not in perms["detail"]
    assert code == 0


def test_iggy_of_another_protocol_version_is_named(tmp_path: Path, broker: Broker) -> None:
    # A server of a later binary-protocol version evicts SDK 0.9.0's login
    # (tests/support/vsr_fake.py models the eviction a real server sends).
    with vsr_fake_in_thread(VsrFake(protocol_minor=12)) as server:
        extra = f'[iggy]\nkind = "iggy"\naddress = "{server.address}"\n'
        config = write_config(tmp_path, port=broker.port, extra=extra)
        code, checks, out = doctor(config, env={"IGGY_PASSWORD": "long-enough-password"})
    assert code == 1
    assert checks["iggy"]["status"] == "fail"
    assert "speaks another Iggy protocol version" in checks["iggy"]["detail"]
    assert "accepts binary protocol 0.12.0" in checks["iggy"]["detail"]
    assert "fix: run iggy-server 0.9.x for this agent (apache-iggy 0.9.0)" in out


SNIPPET = Path(__file__).resolve().parent.parent / "packaging" / "mosquitto" / "iggy-edge.conf"


@pytest.mark.unit
def test_broker_config_check_reads_the_include_dir(tmp_path: Path) -> None:
    """The local Mosquitto's options that decide what the agent's session
    keeps (docs/operations.md): read like Mosquitto reads them, main file
    then each include_dir's .conf files in order, a later line winning."""
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"persistence true\n# queue_qos0_messages true\ninclude_dir {conf_d}\n")
    settings = parse_config({"gateway_id": "gw", "state_dir": str(tmp_path / "state")}, env={})
    bare = check_broker_config(settings, conf)
    assert bare.status == "warn"
    assert "max_queued_messages 1000:" in bare.detail  # Mosquitto's default, no snippet yet
    (conf_d / "iggy-edge.conf").write_text(SNIPPET.read_text())  # the shipped snippet
    shipped = check_broker_config(settings, conf)
    assert shipped.status == "ok", shipped
    assert shipped.detail.startswith(f"read {conf} (name another with --mosquitto-conf PATH): ")
    (conf_d / "local.conf").write_text("queue_qos0_messages true\n")
    qos0 = check_broker_config(settings, conf)
    assert qos0.status == "warn"
    assert "queue_qos0_messages true" in qos0.detail
    assert "max_queued" not in qos0.detail
    assert "remove queue_qos0_messages" in qos0.fix
    remote = parse_config(
        {"gateway_id": "gw", "state_dir": str(tmp_path / "state"), "mqtt": {"host": "broker.lan"}}, env={}
    )
    assert check_broker_config(remote, conf).status == "skip"
    assert check_broker_config(settings, tmp_path / "absent.conf").status == "skip"
