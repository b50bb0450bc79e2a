"""Configuration: every problem reported with its dotted key, env overrides,
credentials file, secrets never printed."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest
from iggy_edge.cli.main import app
from iggy_edge.config import (
    BufferSettings,
    ConfigError,
    DownlinkSettings,
    ForwardSettings,
    IggySettings,
    LoggingSettings,
    MetricsSettings,
    MqttSettings,
    ReceiptSettings,
    RouteSettings,
    Settings,
    load_config,
    parse_config,
)
from pydantic import BaseModel
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

MINIMAL = 'gateway_id = "gw-1"\n'


def write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def problem_keys(err: ConfigError) -> set[str]:
    return {k for k, _ in err.problems}


def test_minimal_config_gets_documented_defaults(tmp_path: Path) -> None:
    s = load_config(write(tmp_path, MINIMAL), env={})
    assert s.gateway_id == "gw-1"
    assert s.mqtt_client_id == "iggy-edge-gw-1"
    assert s.buffer_path == Path("/var/lib/iggy-edge/buffer.db")
    assert s.iggy.kind == "none"
    assert s.mqtt.session_expiry_s > 0  # a persistent session needs a non-zero expiry
    assert s.buffer.synchronous == "full"
    assert [r.topic for r in s.routes] == ["acks", "events", "telemetry"]


def test_full_valid_config(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        """
gateway_id = "plant-7_a"
state_dir = "{tmp_path}/state"
[mqtt]
host = "broker.local"
port = 8883
tls = true
subscriptions = [{ filter = "site/+/up/#", qos = 1 }, { filter = "#", qos = 0 }]
[iggy]
kind = "iggy"
address = "iggy.example:8090"
[[routes]]
filter = "site/+/up/#"
stream = "plant"
topic = "telemetry"
key_level = 1
[buffer]
max_records = 10
overflow = "reject_new"
ttl_s = 0
synchronous = "normal"
[forward]
batch_records = 5
""".replace("{tmp_path}", str(tmp_path)),
    )
    s = load_config(cfg, env={})
    assert s.mqtt.port == 8883
    assert s.routes[0].stream == "plant"
    assert s.buffer.overflow == "reject_new"
    assert s.iggy.address == "iggy.example:8090"


def test_every_problem_is_reported_with_its_dotted_key(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        """
gateway_id = "has space"
colour = "blue"
[mqtt]
port = 70000
reconnect_min_s = 5
reconnect_max_s = 1
subscriptions = [{ filter = "a/#/b" }]
[iggy]
kind = "file"
[[routes]]
filter = "edge/+/up/#"
stream = "bad name!"
[[routes]]
filter = "x/y"
key_level = -1
[buffer]
overflow = "block"
max_records = 0
synchronous = "off"
[forward]
backoff_initial_s = 10
backoff_max_s = 1
""",
    )
    with pytest.raises(ConfigError) as info:
        load_config(cfg, env={})
    keys = problem_keys(info.value)
    expected = {
        "gateway_id",
        "colour",
        "mqtt.port",
        "mqtt.subscriptions[0].filter",
        "iggy",
        "routes[0].stream",
        "routes[1].key_level",
        "buffer.overflow",
        "buffer.max_records",
        "buffer.synchronous",
        "forward",
    }
    assert expected <= keys, keys
    # cross-field checks name the fields in their message
    msgs = dict(info.value.problems)
    assert "file_path" in msgs["iggy"]
    assert "backoff_max_s" in msgs["forward"]
    assert msgs["colour"] == "unknown key (typo?)"
    assert str(cfg) in str(info.value)


def test_missing_gateway_id_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "[mqtt]\nport = 1883\n"), env={})
    assert info.value.problems == [("gateway_id", "required key is missing")]
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "gateway_id = \n", "broken.toml"), env={})
    assert info.value.problems[0][0] == "config"
    assert "not valid TOML" in info.value.problems[0][1]
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.toml", env={})
    assert info.value.problems == [("config", "file not found")]


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, MINIMAL + '[mqtt]\nhost = "file-host"\n[iggy]\nusername = "from-file"\n')
    env = {
        "IGGY_ADDRESS": "10.0.0.5:8090",
        "IGGY_USERNAME": "edge-user",
        "IGGY_PASSWORD": "s3cret-iggy",
        "IGGY_TLS": "true",
        "IGGY_TLS_DOMAIN": "iggy.example",
        "IGGY_EDGE_MQTT_HOST": "env-host",
        "IGGY_EDGE_MQTT_PORT": "1999",
        "IGGY_EDGE_MQTT_USERNAME": "mq",
        "IGGY_EDGE_MQTT_PASSWORD": "s3cret-mqtt",
    }
    s = load_config(cfg, env=env)
    assert s.iggy.kind == "iggy"  # IGGY_ADDRESS switches the uplink on
    assert s.iggy.address == "10.0.0.5:8090"
    assert s.iggy.username == "edge-user"
    assert s.iggy.password is not None
    assert s.iggy.password.get_secret_value() == "s3cret-iggy"
    assert s.iggy.tls is True
    assert s.iggy.tls_domain == "iggy.example"
    assert (s.mqtt.host, s.mqtt.port, s.mqtt.username) == ("env-host", 1999, "mq")
    assert s.mqtt.password is not None
    assert s.mqtt.password.get_secret_value() == "s3cret-mqtt"
    assert load_config(cfg, env={"IGGY_TLS": "0"}).iggy.tls is False


def test_bad_environment_value_is_reported_with_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            write(tmp_path, MINIMAL), env={"IGGY_EDGE_MQTT_PORT": "not-a-port", "IGGY_ADDRESS": "nohost"}
        )
    assert {"mqtt.port", "iggy"} <= problem_keys(info.value)


def test_credentials_file_fills_secrets(tmp_path: Path) -> None:
    cred = write(
        tmp_path,
        '[mqtt]\nusername = "dev"\npassword = "mq-pass"\n[iggy]\npassword = "ig-pass"\n',
        "creds.toml",
    )
    cred.chmod(0o600)
    s = load_config(write(tmp_path, 'credentials_file = "creds.toml"\n' + MINIMAL), env={})
    assert s.mqtt.username == "dev"
    assert s.mqtt.password is not None
    assert s.mqtt.password.get_secret_value() == "mq-pass"
    assert s.iggy.password is not None
    assert s.iggy.password.get_secret_value() == "ig-pass"
    # the environment still wins over the credentials file
    s = load_config(tmp_path / "cfg.toml", env={"IGGY_PASSWORD": "env-pass"})
    assert s.iggy.password is not None
    assert s.iggy.password.get_secret_value() == "env-pass"


def test_credentials_file_problems(tmp_path: Path) -> None:
    write(tmp_path, '[mqtt]\ntoken = "x"\n[other]\npassword = "y"\n', "creds.toml")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, 'credentials_file = "creds.toml"\n' + MINIMAL), env={})
    assert problem_keys(info.value) == {"credentials_file.mqtt.token", "credentials_file.other"}
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, 'credentials_file = "nope.toml"\n' + MINIMAL), env={})
    assert info.value.problems == [("credentials_file", "file not found")]


def test_secrets_are_masked_in_repr(tmp_path: Path) -> None:
    s = parse_config({"gateway_id": "g", "iggy": {"password": "hunter2"}}, env={})
    assert "hunter2" not in repr(s)
    assert "hunter2" not in str(s.model_dump())


# -- the CLI ------------------------------------------------------------------

runner = CliRunner()


def test_config_check_ok_exits_0(tmp_path: Path) -> None:
    result = runner.invoke(app, ["config", "check", str(write(tmp_path, MINIMAL))], env={})
    assert result.exit_code == 0, result.output
    assert "ok" in result.stdout
    assert "gateway gw-1" in result.stdout


def test_config_check_bad_exits_2_with_keys_on_stderr(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'gateway_id = "g"\n[mqtt]\nport = 0\n[buffer]\noverflow = "x"\n')
    result = runner.invoke(app, ["config", "check", str(cfg)], env={})
    assert result.exit_code == 2
    assert "mqtt.port" in result.stderr
    assert "buffer.overflow" in result.stderr
    assert "ok" not in result.stdout


def test_config_check_show_never_prints_secrets(tmp_path: Path) -> None:
    write(tmp_path, '[iggy]\npassword = "cred-file-secret"\n', "creds.toml")
    cfg = write(tmp_path, 'credentials_file = "creds.toml"\n' + MINIMAL)
    env = {"IGGY_EDGE_MQTT_USERNAME": "u", "IGGY_EDGE_MQTT_PASSWORD": "env-mqtt-secret"}
    result = runner.invoke(app, ["config", "check", "--show", str(cfg)], env=env)
    assert result.exit_code == 0, result.output
    assert "cred-file-secret" not in result.output
    assert "env-mqtt-secret" not in result.output
    shown = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    assert shown["iggy"]["password"] == "**********"
    assert shown["mqtt"]["password"] == "**********"
    assert shown["mqtt"]["username"] == "u"


# -- the shipped, annotated example ------------------------------------------------


def example_config() -> Path:
    path = Path(str(resources.files("iggy_edge") / "examples" / "config.toml"))
    assert path.is_file(), "the annotated example ships as package data"
    return path


def test_config_check_accepts_the_shipped_example() -> None:
    result = runner.invoke(app, ["config", "check", str(example_config())], env={})
    assert result.exit_code == 0, result.output


def test_example_states_the_real_defaults() -> None:
    """Every value the example sets is the documented default, so the file
    and the code cannot drift apart."""
    example = load_config(example_config(), env={})
    defaults = parse_config({"gateway_id": example.gateway_id}, env={})
    assert example == defaults


def test_example_mentions_every_key() -> None:
    text = example_config().read_text()
    sections: dict[str, type[BaseModel]] = {
        "": Settings,
        "mqtt": MqttSettings,
        "iggy": IggySettings,
        "routes": RouteSettings,
        "buffer": BufferSettings,
        "forward": ForwardSettings,
        "downlink": DownlinkSettings,
        "receipts": ReceiptSettings,
        "metrics": MetricsSettings,
        "logging": LoggingSettings,
    }
    missing = []
    for section, model in sections.items():
        for name in model.model_fields:
            if name in sections or name == "password":  # secrets: env or credentials file only
                continue
            if not re.search(rf"^#?\s*{name} =", text, re.MULTILINE):
                missing.append(f"{section}.{name}".lstrip("."))
    assert not missing, f"keys not explained in examples/config.toml: {missing}"
    assert "credentials_file" in text
    assert "IGGY_PASSWORD" in text
    assert "IGGY_EDGE_MQTT_PASSWORD" in text
    assert not re.search(r"^\s*password\s*=", text, re.MULTILINE), "no secret in the example"


def test_config_reference_documents_every_key() -> None:
    """docs/config.md (the packaged and generated configs point to it) names
    every key of every section."""
    text = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    sections: dict[str, type[BaseModel]] = {
        "": Settings,
        "mqtt": MqttSettings,
        "iggy": IggySettings,
        "routes": RouteSettings,
        "buffer": BufferSettings,
        "forward": ForwardSettings,
        "downlink": DownlinkSettings,
        "receipts": ReceiptSettings,
        "metrics": MetricsSettings,
        "logging": LoggingSettings,
    }
    missing = []
    for section, model in sections.items():
        if section and f"`[{section}]`" not in text and f"`[[{section}]]`" not in text:
            missing.append(f"[{section}]")
        for name in model.model_fields:
            if name not in sections and f"`{name}`" not in text:
                missing.append(f"{section}.{name}".lstrip("."))
    assert not missing, f"not in docs/config.md: {missing}"
    assert "`credentials_file`" in text


# -- strict types, passwords in the main file, --json ------------------------------


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        (
            '[mqtt]\nport = "1883"\n',
            "mqtt.port",
            "must be an integer, not a string '1883' (write it without quotes)",
        ),
        ("[mqtt]\ntls = 1\n", "mqtt.tls", "must be true or false, not an integer 1"),
        ('[iggy]\ncreate_missing = "false"\n', "iggy.create_missing", "must be true or false, not a string"),
        ("[buffer]\nmax_records = true\n", "buffer.max_records", "must be an integer, not a boolean True"),
        ('[forward]\nlinger_ms = "5"\n', "forward.linger_ms", "must be a number, not a string '5'"),
        ("[buffer]\nmax_records = 10.0\n", "buffer.max_records", "must be an integer, not a float 10.0"),
    ],
)
def test_toml_values_of_the_wrong_type_are_refused_not_converted(
    tmp_path: Path, text: str, key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, MINIMAL + text), env={})
    assert [(k, m) for k, m in e.value.problems if k == key and says in m], e.value.problems


def test_strict_types_still_take_the_environments_strings_and_toml_ints_for_floats(tmp_path: Path) -> None:
    s = load_config(
        write(tmp_path, MINIMAL + "[forward]\nlinger_ms = 5\n"),
        env={"IGGY_EDGE_MQTT_PORT": "1884", "IGGY_TLS": "true", "IGGY_ADDRESS": "10.0.0.1:8090"},
    )
    assert (s.mqtt.port, s.iggy.tls, s.forward.linger_ms) == (1884, True, 5.0)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, MINIMAL), env={"IGGY_EDGE_MQTT_PORT": "eighty"})
    assert [k for k, _ in e.value.problems] == ["mqtt.port"]


def test_config_check_warns_of_a_password_in_the_main_file(tmp_path: Path) -> None:
    cfg = write(tmp_path, MINIMAL + '[mqtt]\nusername = "u"\npassword = "in-the-file"\n')
    result = runner.invoke(app, ["config", "check", str(cfg)], env={})
    assert result.exit_code == 0, result.output
    assert "warning: mqtt.password: a password in the main config file; put it in /etc/iggy-edge/env" in (
        result.stderr
    )
    assert "in-the-file" not in result.output
    clean = runner.invoke(app, ["config", "check", str(write(tmp_path, MINIMAL, "clean.toml"))], env={})
    assert "warning" not in clean.output


def test_config_check_json(tmp_path: Path) -> None:
    cfg = write(tmp_path, MINIMAL + '[iggy]\npassword = "in-the-file"\n')
    result = runner.invoke(app, ["config", "check", "--json", str(cfg)], env={})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["ok"], doc["gateway_id"], doc["problems"]) == (True, "gw-1", [])
    assert [w["key"] for w in doc["warnings"]] == ["iggy.password"]
    assert "in-the-file" not in result.stdout
    bad = write(tmp_path, 'gateway_id = "g"\n[mqtt]\nport = "1883"\n', "bad.toml")
    result = runner.invoke(app, ["config", "check", "--json", str(bad)], env={})
    assert result.exit_code == 2
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    assert [p["key"] for p in doc["problems"]] == ["mqtt.port"]
    assert result.stderr == ""
