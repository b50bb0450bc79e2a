"""The device-id rule, and the gateway-id rule beside it, in one place.

A device id is, all at once, a device's MQTT user name, its client id
(``use_username_as_clientid``), one level of its topics (``%u`` in the
broker's ACL), a key in the receipts and per-device tables, and the
``device`` of a command or desired config that the cloud side sends.  So one
rule serves every boundary a device id crosses: `device credentials` (the
password file), the return poll (a command for any other name is a dead
letter) and doctor (names in the devices' password file).

The rule is deliberately narrow: 1-64 characters of ASCII letters, digits,
``.``, ``_`` and ``-``, starting with a letter or digit.  That leaves out
every character that means something to MQTT (``/``, ``+``, ``#``), to the
password file (``:``), to a terminal (control characters) or to an encoder
(surrogates, noncharacters), so a valid id is safe to print, to publish to
and to store.  Names starting with ``iggy-edge`` are reserved for the
agent's own MQTT sessions (``iggy-edge-<gateway>[-deliver|-doctor]``).

The gateway id (`gateway_id` in the config) is not a device id and has its
own, narrower rule: no ``.``.  It ends the names of the gateway's Iggy
topics, ``{commands_topic}.{gateway_id}`` and ``{config_topic}.{gateway_id}``,
after a ``.``: with no dot in the gateway id, what follows the last dot of
a topic name is its gateway, however the (dotted) topic parts are spelled.
The Debian package derives it from the host name by the same rule
(packaging/deb/postinst, cli/service.py).  Only `config` checks it; every
device id is checked with `device_id_problem`.
"""

from __future__ import annotations

import re
from typing import Final

MAX_CHARS: Final = 64
RESERVED_PREFIX: Final = "iggy-edge"
_RULE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RULE_TEXT: Final = "1-64 characters, ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"
_GATEWAY_RULE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
GATEWAY_RULE_TEXT: Final = "1-64 characters, letters, digits, '-' or '_'"


def device_id_problem(value: object) -> str | None:
    """Why `value` is not a device id, or None when it is one."""
    if not isinstance(value, str):
        return f"a device id must be a string, not {type(value).__name__}"
    if _RULE.fullmatch(value) is None:
        return f"device id {value[:MAX_CHARS]!r} is not usable as an MQTT user and topic level: {RULE_TEXT}"
    if value.lower().startswith(RESERVED_PREFIX):
        return f"device id {value!r} is reserved: names starting with {RESERVED_PREFIX!r} belong to the agent"
    return None


def is_device_id(value: object) -> bool:
    return device_id_problem(value) is None


def gateway_id_problem(value: object) -> str | None:
    """Why `value` is not a gateway id, or None when it is one."""
    if not isinstance(value, str) or _GATEWAY_RULE.fullmatch(value) is None:
        return GATEWAY_RULE_TEXT
    return None
