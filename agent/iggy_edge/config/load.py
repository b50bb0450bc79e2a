"""Reading a configuration: the TOML file, the credentials file, the
environment, then the checks against this machine.

`load_config(path)` returns a frozen `Settings` or raises `ConfigError` that
lists *every* problem with its dotted key (pydantic collects them all).
"""

from __future__ import annotations

import os
import re
import ssl
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from .fields import TRUE_WORDS, ConfigError
from .settings import Settings

# A configuration file is small; anything bigger is not one (and would be
# read into memory whole).
MAX_FILE_BYTES: Final = 1024 * 1024
# The deepest legitimate key is mqtt.subscriptions[0].filter (depth 4); a
# deeper tree is a mistake, refused before validation walks it.
MAX_DEPTH: Final = 16


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError("environment", [(dotted, f"cannot override: {p} is not a table")])
    node[leaf] = value


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    if "IGGY_ADDRESS" in env:
        # "host:port" or a comma-separated list of cluster nodes.
        nodes = [a.strip() for a in env["IGGY_ADDRESS"].split(",") if a.strip()]
        _set(raw, "iggy.address", nodes[0] if nodes else env["IGGY_ADDRESS"])
        _set(raw, "iggy.addresses", nodes if len(nodes) > 1 else [])
        _set(raw, "iggy.kind", "iggy")
    simple = {
        "IGGY_USERNAME": "iggy.username",
        "IGGY_PASSWORD": "iggy.password",
        "IGGY_TOKEN": "iggy.token",
        "IGGY_TLS_CA_FILE": "iggy.tls_ca_file",
        "IGGY_TLS_DOMAIN": "iggy.tls_domain",
        "IGGY_EDGE_MQTT_HOST": "mqtt.host",
        "IGGY_EDGE_MQTT_PORT": "mqtt.port",
        "IGGY_EDGE_MQTT_USERNAME": "mqtt.username",
        "IGGY_EDGE_MQTT_PASSWORD": "mqtt.password",
    }
    for var, key in simple.items():
        if var in env:
            _set(raw, key, env[var])
    # The environment gives strings; the models take TOML's real types.
    port = env.get("IGGY_EDGE_MQTT_PORT", "").strip()
    if re.fullmatch(r"[0-9]{1,5}", port):
        _set(raw, "mqtt.port", int(port))
    if "IGGY_TLS" in env:
        _set(raw, "iggy.tls", env["IGGY_TLS"].strip().lower() in TRUE_WORDS)


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    """Read and parse one TOML file; every way it can fail is a ConfigError
    naming `what` (a file is refused whole: there is no key to name inside
    bytes that are not TOML)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(str(path), [(what, "file not found")]) from None
    except PermissionError:
        raise ConfigError(str(path), [(what, "permission denied")]) from None
    except IsADirectoryError:
        raise ConfigError(str(path), [(what, "is a directory, not a file")]) from None
    except OSError as e:
        raise ConfigError(str(path), [(what, f"cannot read it: {e.strerror or e}")]) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(str(path), [(what, f"larger than {MAX_FILE_BYTES} bytes: not a config file")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            str(path), [(what, f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}")]
        ) from None
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), [(what, f"not valid TOML: {e}")]) from None
    except RecursionError:
        raise ConfigError(str(path), [(what, "not valid TOML: nested too deeply")]) from None
    except ValueError as e:  # an integer beyond Python's 4300-digit conversion limit
        why = "an integer with more than 4300 digits" if "digits" in str(e) else str(e)
        raise ConfigError(str(path), [(what, f"not valid TOML: {why}")]) from None
    _check_depth(tree, str(path), "" if what == "config" else what)
    return tree


def _check_depth(tree: dict[str, Any], source: str, prefix: str) -> None:
    """Refuse a tree nested deeper than MAX_DEPTH, naming the key where the
    nesting starts (its first three levels)."""
    stack: list[tuple[Any, list[str], int]] = [(tree, [prefix] if prefix else [], 0)]
    while stack:
        node, key, depth = stack.pop()
        if depth > MAX_DEPTH:
            name = "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(key[:3]))
            raise ConfigError(source, [(name or "(top level)", f"nested deeper than {MAX_DEPTH} levels")])
        if isinstance(node, dict):
            stack.extend((v, [*key, str(k)], depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, [*key, f"[{i}]"], depth + 1) for i, v in enumerate(node))


def _merge_credentials(raw: dict[str, Any], base: Path) -> None:
    """`credentials_file = "path"` points at a small TOML (mode 0600) holding
    `[mqtt] password` / `[iggy] password`; its values fill the tree."""
    cred = raw.pop("credentials_file", None)
    if cred is None:
        return
    if not isinstance(cred, str) or not cred.strip():
        raise ConfigError("config", [("credentials_file", "must be a path string")])
    if "\x00" in cred:
        raise ConfigError("config", [("credentials_file", "a path cannot contain NUL")])
    path = Path(cred) if Path(cred).is_absolute() else base / cred
    secrets = _read_toml(path, "credentials_file")
    problems: list[tuple[str, str]] = []
    for section, values in secrets.items():
        if section not in ("mqtt", "iggy") or not isinstance(values, dict):
            problems.append((f"credentials_file.{section}", "only [mqtt] and [iggy] tables allowed"))
            continue
        for k, v in values.items():
            if k not in ("username", "password") and (section, k) != ("iggy", "token"):
                problems.append(
                    (f"credentials_file.{section}.{k}", "only username/password (and iggy token) allowed")
                )
            elif not isinstance(v, str):
                problems.append((f"credentials_file.{section}.{k}", "must be a string"))
            else:
                _set(raw, f"{section}.{k}", v)
    if problems:
        raise ConfigError(str(path), problems)


def _file_problem(path: Path, *, need: bool) -> str | None:
    """Why `path` cannot be a file the agent reads or writes, or None.  A
    missing file is a problem only when `need`-ed (the buffer is created)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "file not found" if need else None
    except NotADirectoryError:
        return "a parent of this path is not a directory"
    except OSError as e:
        return f"cannot inspect it: {e.strerror or e}"
    if path.is_dir():
        return "is a directory, not a file"
    if not path.is_file():
        return f"is not a regular file (mode {oct(st.st_mode)[-6:]}); name a file"
    return None


def _ca_problem(path: Path) -> str | None:
    problem = _file_problem(path, need=True)
    if problem:
        return problem
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError, ValueError) as e:
        return f"not a PEM CA bundle: {e}"
    return None


def _machine_problems(s: Settings) -> list[tuple[str, str]]:
    """Checks against this machine and across sections, each with its key:
    what would otherwise fail only once the agent runs."""
    problems: list[tuple[str, str]] = []
    if s.state_dir.exists() and not s.state_dir.is_dir():
        problems.append(("state_dir", "exists and is not a directory"))
    key = "buffer.path" if s.buffer.path is not None else "state_dir"
    problem = _file_problem(s.buffer_path, need=False)
    if problem:
        problems.append((key, f"{s.buffer_path} {problem}"))
    elif s.buffer_path.name in ("", ".", ".."):
        problems.append((key, f"{s.buffer_path} does not name a file"))
    for section, ca in (("mqtt", s.mqtt.tls_ca_file), ("iggy", s.iggy.tls_ca_file)):
        if ca is not None and (problem := _ca_problem(ca)):
            problems.append((f"{section}.tls_ca_file", f"{ca}: {problem}"))
    if s.iggy.kind == "file" and s.iggy.file_path is not None:
        problem = _file_problem(s.iggy.file_path, need=False)
        if problem:
            problems.append(("iggy.file_path", f"{s.iggy.file_path} {problem}"))
    deliver_id = s.downlink.client_id or f"{s.mqtt_client_id}-deliver"
    if deliver_id == s.mqtt_client_id:
        problems.append(
            (
                "downlink.client_id",
                "must differ from mqtt.client_id (the broker would drop one for the other)",
            )
        )
    return problems


def _key(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p.startswith(("function-after", "function-before")):
            continue
        else:
            parts.append(("." if parts else "") + p)
    return "".join(parts) or "(top level)"


def parse_config(
    raw: dict[str, Any], *, source: str = "config", env: Mapping[str, str] | None = None
) -> Settings:
    """Validate an already-read TOML tree (plus environment overrides)."""
    raw = dict(raw)
    _apply_env(raw, os.environ if env is None else env)
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (typo?)"
            elif err["type"] == "missing":
                msg = "required key is missing"
            problems.append((_key(err["loc"]), msg.removeprefix("Value error, ")))
        raise ConfigError(source, problems) from None
    problems = _machine_problems(settings)
    if problems:
        raise ConfigError(source, problems)
    return settings


def passwords_in_file(path: Path) -> list[str]:
    """The keys of passwords written in the main config file itself (they
    belong in /etc/iggy-edge/env or a credentials_file: the main file is
    world-readable and gets copied, diffed and pasted)."""
    raw = _read_toml(path, "config")
    return [
        f"{section}.{key}"
        for section, key in (("mqtt", "password"), ("iggy", "password"), ("iggy", "token"))
        if isinstance(raw.get(section), dict) and key in raw[section]
    ]


def load_config(path: Path, *, env: Mapping[str, str] | None = None) -> Settings:
    raw = _read_toml(path, "config")
    _merge_credentials(raw, path.parent)
    return parse_config(raw, source=str(path), env=env)
