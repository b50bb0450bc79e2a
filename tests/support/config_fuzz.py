"""Mutated configuration files for the config fuzz test (and a counting driver).

`mutate(rng, tmp)` starts from the annotated example (or a minimal file) and
applies one to four mutations drawn from `rng`: byte flips (often into bytes
that are not UTF-8), truncation, a value swapped for one of another type, a
random key, deep nesting, a huge number, a bad credentials file or a bad
environment override.  It writes the case under `tmp` and returns it.
`outcome(case)` runs the loader in-process and classifies the result:
"ok", "refused" (ConfigError naming a key) or "traceback:<exception>".

The test drives `mutate` through hypothesis (`st.randoms()`), so failures
shrink and replay; ``python -m tests.support.config_fuzz N`` draws N cases
from seeded `random.Random`s and prints the counts, which is how the
before/after figures in the issue were measured.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from iggy_edge.config import ConfigError, Settings, load_config
from iggy_edge.httpd import local_url

EXAMPLE = (resources.files("iggy_edge") / "examples" / "config.toml").read_bytes()
MINIMAL = b'gateway_id = "gw-fuzz"\n'

# Values of every TOML type, including the ones that broke the agent.
ODD_VALUES: list[Any] = [
    "",
    " ",
    "nonsense",
    "9108",
    "/dev/null",
    "/",
    "\x00",
    "a\x00b",
    "+",
    "#",
    "a/#/b",
    "a+b",
    "x" * 70_000,
    0,
    -1,
    1,
    65536,
    2**31,
    2**32,
    4294967296,
    2**63 - 1,
    -(2**63),
    0.0,
    -0.0,
    1e-300,
    1e308,
    math.inf,
    -math.inf,
    math.nan,
    True,
    False,
    [],
    [1, "a"],
    {},
    {"filter": ""},
    {"x": {"y": 1}},
]

KEYS_SEEN_IN_EXAMPLE = [
    "gateway_id",
    "state_dir",
    "host",
    "port",
    "client_id",
    "username",
    "tls",
    "tls_ca_file",
    "keepalive_s",
    "session_expiry_s",
    "receive_maximum",
    "reconnect_min_s",
    "reconnect_max_s",
    "subscriptions",
    "filter",
    "qos",
    "kind",
    "address",
    "request_timeout_s",
    "connect_timeout_s",
    "create_missing",
    "partitions",
    "file_path",
    "stream",
    "topic",
    "key_level",
    "path",
    "max_records",
    "max_bytes",
    "overflow",
    "ttl_s",
    "synchronous",
    "commit_interval_ms",
    "commit_max_records",
    "max_payload_bytes",
    "max_dead_letters",
    "batch_records",
    "batch_bytes",
    "linger_ms",
    "backoff_initial_s",
    "backoff_max_s",
    "enabled",
    "commands_topic",
    "config_topic",
    "poll_interval_s",
    "poll_batch",
    "max_inbox",
    "default_ttl_s",
    "command_topic",
    "config_mqtt_topic",
    "ack_filter",
    "deliver_window",
    "publish_timeout_s",
    "mirror_timeout_s",
    "history_s",
    "listen",
    "uplink_down_unhealthy_s",
    "level",
    "format",
]

ENV_VARS = [
    "IGGY_ADDRESS",
    "IGGY_USERNAME",
    "IGGY_PASSWORD",
    "IGGY_TLS",
    "IGGY_TLS_CA_FILE",
    "IGGY_TLS_DOMAIN",
    "IGGY_EDGE_MQTT_HOST",
    "IGGY_EDGE_MQTT_PORT",
    "IGGY_EDGE_MQTT_USERNAME",
    "IGGY_EDGE_MQTT_PASSWORD",
]


@dataclass
class Case:
    config: Path
    env: dict[str, str] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)


# -- a small TOML writer for type swaps (inline values only) -----------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # JSON's escapes are TOML's, except that TOML wants \u for control chars,
        # which json.dumps already does.
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))  # datetimes and the like: as a string


def toml_dump(tree: dict[str, Any]) -> str:
    """Top-level scalars, then one [table] per dict, arrays of tables inline."""
    head = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in tree.items() if not isinstance(v, dict)]
    tables = [
        f"[{json.dumps(k)}]\n" + "".join(f"{json.dumps(kk)} = {toml_value(vv)}\n" for kk, vv in v.items())
        for k, v in tree.items()
        if isinstance(v, dict)
    ]
    return "\n".join(head) + "\n" + "\n".join(tables)


# -- mutations ----------------------------------------------------------------


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    if isinstance(tree, dict):
        items: list[tuple[Any, Any]] = list(tree.items())
    elif isinstance(tree, list):
        items = list(enumerate(tree))
    else:
        return out
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _put(tree: Any, path: tuple[Any, ...], value: Any) -> None:
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _huge_int(rng: random.Random) -> str:
    digits = rng.choice([4300, 4301, 5000, 20_000])
    return rng.choice("123456789") + "".join(rng.choice("0123456789") for _ in range(digits - 1))


def _deep(rng: random.Random) -> str:
    depth = rng.choice([50, 500, 999, 1000, 3000, 5000])
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return "{a = " * depth + "1" + "}" * depth


def _odd_value(rng: random.Random) -> Any:
    return rng.choice(ODD_VALUES)


def mutate(rng: random.Random, tmp: Path) -> Case:
    data = bytearray(EXAMPLE if rng.random() < 0.8 else MINIMAL)
    case = Case(tmp / "config.toml")
    for _ in range(1 if rng.random() < 0.5 else rng.randint(2, 4)):
        kind = rng.choice(
            ["flip", "flip", "truncate", "swap", "swap", "swap", "key", "deep", "huge", "cred", "env"]
        )
        case.steps.append(kind)
        if kind == "flip" and data:
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(data))
                data[pos] = rng.choice([rng.randrange(256), 0xFF, 0xC3, 0x80, 0x00, ord("["), ord('"')])
        elif kind == "truncate" and data:
            del data[rng.randrange(len(data)) :]
        elif kind in ("swap", "key"):
            try:
                tree = tomllib.loads(data.decode())
            except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError, ValueError):
                continue
            paths = _paths(tree)
            if kind == "swap" and paths:
                path = rng.choice(paths)
                value = _odd_value(rng)
                case.steps.append(f"{'.'.join(map(str, path))}={toml_value(value)[:40]}")
                _put(tree, path, value)
            else:
                tables = [()] + [p for p in paths if isinstance(_get(tree, p), dict)]
                where = rng.choice(tables)
                name = rng.choice([*KEYS_SEEN_IN_EXAMPLE, "".join(rng.choices("abcxyz_-", k=5))])
                node = _get(tree, where)
                node[name] = _odd_value(rng)
                case.steps.append(f"+{'.'.join(map(str, (*where, name)))}")
            data = bytearray(toml_dump(tree).encode())
        elif kind == "deep":
            key = rng.choice(["x", "routes", "gateway_id", "mqtt.subscriptions"])
            line = f"{key} = {_deep(rng)}\n"
            data = bytearray(line.encode()) + data if "." not in key else data + b"\n" + line.encode()
        elif kind == "huge":
            text = data.decode("utf-8", "replace")
            numbers = list(re.finditer(r"(?m)= (\d+)$", text))
            if numbers:
                m = rng.choice(numbers)
                text = text[: m.start(1)] + _huge_int(rng) + text[m.end(1) :]
            else:
                text = f"port = {_huge_int(rng)}\n" + text
            data = bytearray(text.encode("utf-8", "surrogateescape"))
        elif kind == "cred" and not any(st.startswith("cred:") for st in case.steps):
            cred = tmp / "creds.toml"
            variant = rng.choice(["dir", "binary", "deep", "huge", "bad_key", "missing", "ok", "nul"])
            case.steps.append(f"cred:{variant}")
            name = "creds.toml"
            if variant == "dir":
                cred.mkdir(exist_ok=True)
            elif variant == "binary":
                cred.write_bytes(b'[mqtt]\npassword = "' + bytes([0xFF, 0xFE, 0xC3]) + b'"\n')
            elif variant == "deep":
                cred.write_text(f"[mqtt]\npassword = {_deep(rng)}\n")
            elif variant == "huge":
                cred.write_text(f"[mqtt]\npassword = {_huge_int(rng)}\n")
            elif variant == "bad_key":
                cred.write_text('[mqtt]\ntoken = "x"\n[other]\npassword = "y"\n')
            elif variant == "ok":
                cred.write_text('[mqtt]\nusername = "u"\npassword = "p-123456"\n')
            elif variant == "nul":
                name = "creds\\u0000.toml"
            else:
                name = "absent.toml"
            data = bytearray(f'credentials_file = "{name}"\n'.encode()) + data
        elif kind == "env":
            var = rng.choice(ENV_VARS)
            value = rng.choice(["", "x", "0", "99999999999", _huge_int(rng), "host:", ":1", "/", "a\ufffd"])
            case.env[var] = value
            case.steps.append(f"env:{var}")
    if not case.config.is_dir():
        case.config.write_bytes(bytes(data))
    return case


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    node = tree
    for p in path:
        node = node[p]
    return node


def _floats(tree: Any) -> list[float]:
    if isinstance(tree, float):
        return [tree]
    if isinstance(tree, dict):
        return [f for v in tree.values() for f in _floats(v)]
    if isinstance(tree, list | tuple):
        return [f for v in tree for f in _floats(v)]
    return []


def unusable(s: Settings) -> str | None:
    """An oracle written apart from the validators: what the running agent
    needs of an accepted config (each line is a way it broke before)."""
    try:
        local_url(s.metrics.listen)
    except ValueError:
        return "metrics.listen unusable"
    if not all(math.isfinite(f) for f in _floats(s.model_dump())):
        return "a non-finite number"
    if not 0 < s.mqtt.session_expiry_s <= 0xFFFFFFFF:
        return "mqtt.session_expiry_s does not fit MQTT's four bytes"
    if not s.routes:
        return "no routes"
    filters = [r.filter for r in s.routes] + [x.filter for x in s.mqtt.subscriptions]
    for f in [*filters, s.downlink.ack_filter]:
        levels = f.split("/")
        if (
            not f
            or "\x00" in f
            or any(("#" in lv and (lv != "#" or i < len(levels) - 1)) for i, lv in enumerate(levels))
        ):
            return f"topic filter {f!r}"
        if any("+" in lv and lv != "+" for lv in levels):
            return f"topic filter {f!r}"
    if not s.mqtt.host.strip():
        return "empty mqtt.host"
    if str(s.state_dir) in ("", ".") or "\x00" in str(s.state_dir):
        return "state_dir"
    if s.buffer_path.exists() and not s.buffer_path.is_file():
        return "buffer path is not a file"
    for ca in (s.mqtt.tls_ca_file, s.iggy.tls_ca_file):
        if ca is not None and not ca.is_file():
            return "tls_ca_file is not a file"
    return None


def outcome(case: Case) -> str:
    """ "ok", "refused", "unusable:<why>" (accepted, but the agent would
    break) or "traceback:<type>" (anything but a clean ConfigError)."""
    try:
        settings = load_config(case.config, env=case.env)
    except ConfigError as e:
        if not e.problems or any(not k or k == "(top level)" or not m for k, m in e.problems):
            return f"traceback:unnamed problem {e.problems!r}"
        return "refused"
    except BaseException as e:
        return f"traceback:{type(e).__name__}"
    try:
        why = unusable(settings)
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__} on a path"
    return "ok" if why is None else f"unusable:{why}"


def main(argv: list[str]) -> None:
    n = int(argv[1]) if len(argv) > 1 else 1000
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for seed in range(n):
        with tempfile.TemporaryDirectory() as d:
            case = mutate(random.Random(seed), Path(d))
            try:
                result = outcome(case)
            except RecursionError:
                result = "traceback:RecursionError"
        counts[result] = counts.get(result, 0) + 1
        if not result.startswith(("ok", "refused")) and len(examples.setdefault(result, [])) < 3:
            examples[result].append(f"seed {seed}: {' '.join(case.steps)[:120]}")
    tracebacks = sum(v for k, v in counts.items() if k.startswith("traceback"))
    unusable = sum(v for k, v in counts.items() if k.startswith("unusable"))
    print(json.dumps({"cases": n, "tracebacks": tracebacks, "accepted_unusable": unusable, "counts": counts}))
    for kind, ex in examples.items():
        print(kind, *ex, sep="\n  ")


if __name__ == "__main__":
    main(sys.argv)
