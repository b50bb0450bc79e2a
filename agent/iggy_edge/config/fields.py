"""The field types every section shares, each with its one validator.

A rule that two sections need (an MQTT topic filter, a host, a path, an Iggy
name, a ``{device}`` topic template, a bounded number of seconds) is an
`Annotated` type here, so it is written once and reads the same in every
section.  `_Model` is the base of every section: frozen, no unknown keys, no
inf/nan, and TOML's real types taken strictly.
"""

from __future__ import annotations

import ipaddress
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from ..device_ids import gateway_id_problem
from ..topics import prefix_problem

IGGY_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
TRUE_WORDS: Final = frozenset({"1", "true", "yes", "on"})
MAX_MQTT_STRING_BYTES: Final = 65535  # MQTT's UTF-8 string length field
MAX_SESSION_EXPIRY_S: Final = 0xFFFFFFFF  # MQTT 5: a four-byte integer
MAX_PAYLOAD_BYTES: Final = 268_435_455  # MQTT's largest packet
TEN_YEARS_S: Final = 10 * 365 * 24 * 3600
MAX_WAIT_S: Final = 3600.0  # timeouts, backoff bounds, poll intervals
# A topic with a device id (at most 64 bytes, device_ids.py) must fit in the
# 255 bytes an Iggy header value carries (routing.py).
MAX_TEMPLATE_BYTES: Final = 255 - 64


class ConfigError(Exception):
    """A configuration cannot be used.  `problems` is a list of (key, message)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


def topic_filter_problem(v: str) -> str | None:
    """Why `v` is not a valid MQTT topic filter (MQTT 5, section 4.7), or None."""
    if not v:
        return "an MQTT topic filter cannot be empty"
    if "\x00" in v:
        return "an MQTT topic filter cannot contain NUL"
    if len(v.encode()) > MAX_MQTT_STRING_BYTES:
        return f"an MQTT topic filter is at most {MAX_MQTT_STRING_BYTES} bytes"
    levels = v.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return f"not a valid MQTT topic filter: {v!r} ('#' only as the whole last level)"
        if "+" in level and level != "+":
            return f"not a valid MQTT topic filter: {v!r} ('+' only as a whole level)"
    return None


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); the host is an IP
    address or ``localhost`` (empty means 127.0.0.1).  Raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port with a port 1-65535, e.g. 127.0.0.1:9108; got {listen!r}")
    host = host.strip("[]") or "127.0.0.1"
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"the host must be an IP address or localhost (the address to listen on), got {host!r}"
            ) from None
    return host, int(port)


def _problem_to_error(check: typing.Callable[[Any], str | None]) -> typing.Callable[[Any], Any]:
    """A validator from a `..._problem` function (None: valid)."""

    def validate(v: Any) -> Any:
        problem = check(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    return validate


def _mqtt_string(v: str) -> str:
    if "\x00" in v:
        raise ValueError("cannot contain NUL")
    if len(v.encode()) > MAX_MQTT_STRING_BYTES:
        raise ValueError(f"at most {MAX_MQTT_STRING_BYTES} bytes")
    return v


def _host(v: str) -> str:
    if not v or v != v.strip() or any(c.isspace() or c == "\x00" for c in v) or len(v) > 253:
        raise ValueError(f"must be a host name or IP address, got {v!r}")
    return v


def _path_text(v: Any) -> Any:
    """Before pydantic turns it into a Path: "" would become "." (the current
    directory) and a NUL byte fails only when the agent opens the file."""
    if isinstance(v, str):
        if not v.strip():
            raise ValueError("a path cannot be empty")
        if "\x00" in v:
            raise ValueError("a path cannot contain NUL")
        if len(v.encode()) > 4096:
            raise ValueError("a path is at most 4096 bytes")
    return v


def _listen(v: str) -> str:
    parse_listen(v)
    return v


def _iggy_name(v: str) -> str:
    if not IGGY_NAME.fullmatch(v):
        raise ValueError(f"not a valid Iggy name: {v!r} (letters, digits, . _ -)")
    return v


def _device_template(v: str) -> str:
    """A topic with the device id as one whole level, e.g. ``edge/{device}/down/cmd``."""
    if v.count("{device}") != 1 or "+" in v or "#" in v or "\x00" in v:
        raise ValueError("must contain {device} exactly once and no wildcards or NUL")
    head, _, tail = v.partition("{device}")
    if (head and not head.endswith("/")) or not tail.startswith("/"):
        raise ValueError("{device} must be a whole topic level, e.g. edge/{device}/down/receipt")
    if len(v.encode()) > MAX_TEMPLATE_BYTES:
        raise ValueError("at most 191 bytes (the topic with a device id must fit in 255)")
    return v


def require_order(low_name: str, low: float, high_name: str, high: float) -> None:
    """A (min, max) pair of bounds, e.g. backoff: max below min is a mistake."""
    if high < low:
        raise ValueError(f"{high_name} must be >= {low_name}")


TopicFilter = Annotated[str, AfterValidator(_problem_to_error(topic_filter_problem))]
MqttString = Annotated[str, AfterValidator(_mqtt_string)]
Host = Annotated[str, AfterValidator(_host)]
FilePath = Annotated[Path, BeforeValidator(_path_text)]
Listen = Annotated[str, AfterValidator(_listen)]
IggyName = Annotated[str, AfterValidator(_iggy_name)]
DeviceTemplate = Annotated[str, AfterValidator(_device_template)]
GatewayId = Annotated[str, AfterValidator(_problem_to_error(gateway_id_problem))]
TopicPrefix = Annotated[str, AfterValidator(_problem_to_error(prefix_problem))]
PositiveInt = Annotated[int, Field(gt=0)]
Seconds = Annotated[float, Field(gt=0, le=MAX_WAIT_S)]
Lifetime = Annotated[int, Field(ge=0, le=TEN_YEARS_S)]


def _scalar_kinds(annotation: Any) -> set[type]:
    """The int/float/bool types a field takes, when it takes only those (and None)."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else ()
    )
    plain = (
        typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in (args or (annotation,))
    )
    kinds = {a for a in plain if a is not type(None)}
    return kinds if kinds and kinds <= {int, float, bool} else set()


def _strict_scalar(value: Any, kinds: set[type]) -> Any:
    """TOML has real integers, floats and booleans: "1883" for a port or 1
    for a bool is a mistake, not something to convert (pydantic's lax mode
    would).  Environment overrides are converted before (load._apply_env)."""
    if value is None:
        return value
    if bool in kinds and isinstance(value, bool):
        return value
    if not isinstance(value, bool) and (
        (int in kinds and isinstance(value, int)) or (float in kinds and isinstance(value, int | float))
    ):
        return value
    want = " or ".join(
        sorted({int: "an integer", float: "a number", bool: "true or false"}[k] for k in kinds)
    )
    got = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), "a table or list"
    )
    hint = " (write it without quotes)" if isinstance(value, str) else ""
    raise ValueError(f"must be {want}, not {got} {value!r}{hint}")


class _Model(BaseModel):
    # inf and nan are valid TOML floats but no setting means them: inf as a
    # linger or a timeout would wedge a stage, nan compares false to everything.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        kinds = _scalar_kinds(field.annotation) if field is not None else set()
        return _strict_scalar(value, kinds) if kinds else value
