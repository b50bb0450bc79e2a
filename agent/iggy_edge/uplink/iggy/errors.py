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
their text.  A `ValueError` comes from SendMessage itself (empty payload,
empty header value) and never reaches the server.
"""

from __future__ import annotations

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


def is_unsupported_option(error: BaseException) -> bool:
    return "unsupported option key" in str(error).lower()
