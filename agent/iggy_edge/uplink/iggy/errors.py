"""Which `UplinkError` an apache-iggy (SDK 0.9) failure amounts to.

Every SDK error is a `RuntimeError` whose text is the server's or the
client's `IggyError` message; over the binary protocol only the error *code*
comes back, so names inside the text are empty ("Stream with name: already
exists.", "Resource with key:  was not found." for a send to a missing
stream, topic or partition).  `classify` maps those texts to

* `UplinkUnavailable`: nothing was stored (cannot connect, unauthenticated,
  invalid credentials, not accepted);
* `UplinkAmbiguous`: the request may have been written (``Disconnected`` --
  what a lost connection gives --, ``Connection closed``, a timeout,
  "transiently not committed");
* `UplinkRejected`: the server answered with an error a retry will not fix.

"already exists", "not found" and "unsupported option key" are recognised by
their text, and so is the login refusal of a server that speaks another
binary-protocol version (`protocol_mismatch`).  A `ValueError` comes from SendMessage itself (empty payload,
empty header value) and never reaches the server.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Final

from ..protocol import UplinkAmbiguous, UplinkError, UplinkRejected, UplinkUnavailable

# Texts of IggyError variants (core/common/src/error/iggy_error.rs), lower case.
# Checked in this order; the first list wins.
_NOTHING_LEFT: Final = (
    "not connected",
    "cannot establish connection",
    "client shutdown",
    "unauthenticated",
    "invalid credentials",
    "stale client",
    "transiently not accepted",
)
_MAYBE_LEFT: Final = (
    "disconnected",
    "connection closed",
    "tcp error",
    "empty response",
    "transiently not committed",
    "timeout",
)


def classify(error: BaseException) -> type[UplinkError]:
    """Which UplinkError an SDK failure amounts to (by its message text)."""
    if isinstance(error, TimeoutError):
        return UplinkAmbiguous
    if isinstance(error, OSError):
        return UplinkUnavailable
    text = str(error).lower()
    if any(t in text for t in _NOTHING_LEFT):
        return UplinkUnavailable
    if any(t in text for t in _MAYBE_LEFT):
        return UplinkAmbiguous
    return UplinkRejected


def is_already_exists(error: BaseException) -> bool:
    return "already exists" in str(error).lower()


def is_not_found(error: BaseException) -> bool:
    return "not found" in str(error).lower()


def is_unauthorized(error: BaseException) -> bool:
    """The server's "Unauthorized": the user lacks the permission (not the login)."""
    return "unauthorized" in str(error).lower()


def is_unsupported_option(error: BaseException) -> bool:
    return "unsupported option key" in str(error).lower()


class IncompatibleServer(UplinkUnavailable):
    """The server turned the login away because it speaks another version of
    Iggy's binary protocol.  Nothing was stored; retrying only helps once the
    server or the agent changes, so the message says which versions meet."""


# SDK 0.9.0's text for IggyError::IncompatibleProtocolVersion (code 14003),
# what it makes of the server's Eviction frame with reason
# IncompatibleProtocol: "Incompatible binary protocol version: client 0.11.0,
# server accepts [0.12.0, 0.12.0]".
_MISMATCH: Final = re.compile(
    r"incompatible binary protocol version: client (?P<client>[\d.]+), "
    r"server accepts \[(?P<min>[\d.]+), (?P<max>[\d.]+)\]",
    re.IGNORECASE,
)

IGGY_SDK_VERSION: Final = metadata.version("apache-iggy")

COMPATIBILITY: Final = (
    "the agent works with iggy-server 0.9.x through apache-iggy 0.9.x (Iggy 0.10 changed the wire "
    "protocol): point it at a 0.9.x server, or run an iggy-edge release made for that server"
)


def protocol_mismatch(error: BaseException, address: str) -> str | None:
    """What to say when `error` is a login refused for the protocol version
    (None otherwise): both versions and what works with what."""
    m = _MISMATCH.search(str(error))
    if m is None:
        return None
    window = m["min"] if m["min"] == m["max"] else f"{m['min']} to {m['max']}"
    return (
        f"{address} speaks another Iggy protocol version: the server accepts binary protocol "
        f"{window}, this agent's apache-iggy {IGGY_SDK_VERSION} speaks {m['client']}; {COMPATIBILITY}"
    )
