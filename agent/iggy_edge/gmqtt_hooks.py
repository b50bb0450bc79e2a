"""Every use of gmqtt's private internals, in one module, checked before use.

gmqtt (0.8, pinned) is kept for the MQTT session; a handful of things the
agent needs are not in its public API, so they are done here and nowhere else:

* `own_reconnect`: gmqtt reconnects by itself with a fixed delay; ingest,
  deliver and doctor reconnect themselves (backoff with jitter, a fresh
  client per attempt), so gmqtt's reconnect callback is replaced.
* `install_publish_hooks` / `install_connection_hooks` (ingest's fast path):
  every inbound PUBLISH goes to ingest without a task per message and without
  gmqtt's per-packet dispatch (a debug log, a handler lookup, two clock reads),
  and the acknowledgements of a group commit leave in one write (`write`).
  That took ingest from 0.05 to ~0.9 of a bare counting subscriber
  (bench/ingest_bench.py).  Parts: the handler's PUBLISH and QoS1/2 handlers,
  gmqtt's framing (`_read_packet`) again with PUBLISH packets handed to the
  hook directly, a shortcut in the connection's `put_package` that keeps
  gmqtt's keepalive bookkeeping (`_last_data_in`), and a read throttle on the
  protocol's `read`
  (gmqtt's StreamReader resumes the transport on its own, so only waiting in
  `read` makes TCP push back).
* `on_puback`: gmqtt 0.8 does not parse the MQTT 5 PUBACK reason code; deliver
  needs it to tell "delivered" from "refused" (0x87 not authorized).  Deliver
  also learns each publish's packet id through its `persistent_storage` (a
  constructor argument; checked here: `publish` and the PUBACK path still
  call it).
* `refusal_code`: the CONNACK reason of a refused connect, which
  `MQTTConnectError` keeps private (doctor tells bad credentials apart).

The shortcut runs outside gmqtt's own exception guard (the handler's
`__call__`), so it carries its own: an unexpected error is handed to the
sink's `hook_error`, which logs, counts and closes the connection (the session
reconnects and the broker redelivers what was not acknowledged) instead of the
read loop dying silently until keepalive notices.

`check_gmqtt()` verifies, once, every attribute touched and the signature of
every method replaced against the installed gmqtt -- also that gmqtt's own
code still reads the attributes we write (its keepalive reads `_last_data_in`,
its read loop calls `read`, its dispatch finds handlers by name) -- and raises
`GmqttInternalsChanged` naming each difference.  The install functions check
the live objects before changing anything: nothing is ever half-installed.
tests/test_gmqtt_hooks.py is the canary.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any, Final, Protocol

import gmqtt
from gmqtt.mqtt.connection import MQTTConnection
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MQTTConnectError, MqttPackageHandler
from gmqtt.mqtt.package import Package
from gmqtt.mqtt.protocol import MQTTProtocol
from gmqtt.storage import PersistentStorage

from .mqtt_codec import PUBLISH, parse_ack

log = logging.getLogger(__name__)

GMQTT_TESTED: Final = "0.8.0"

# A gmqtt connection, opaque outside this module: ingest keeps it with each
# pending acknowledgement so the ack goes out on the connection that delivered
# the message (or nowhere, if that connection has closed).
Connection = Any


class GmqttInternalsChanged(RuntimeError):
    """The installed gmqtt differs from what the hooks were written against."""


class PublishSink(Protocol):
    """What ingest gives the PUBLISH hooks."""

    def raw_publish(self, conn: Connection, cmd: int, body: bytes, v5: bool) -> bool:
        """A PUBLISH as it came off the wire; False: let gmqtt parse it (properties)."""

    def parsed_publish(
        self, conn: Connection, qos: int, mid: int, topic: str | bytes, payload: bytes, props: dict[str, Any]
    ) -> None:
        """A QoS1/2 PUBLISH that gmqtt's general parser took apart."""

    def hook_error(self, exc: Exception) -> None:
        """An unexpected error while handling a PUBLISH: the caller closes the connection."""


# -- the check ---------------------------------------------------------------------

# (class, method, parameter names) for every method we replace, wrap or call
_SIGNATURES: Final = (
    (MqttPackageHandler, "_handle_publish_packet", ("self", "cmd", "raw_packet")),
    (
        MqttPackageHandler,
        "_handle_qos_1_publish_packet",
        ("self", "mid", "packet", "print_topic", "properties"),
    ),
    (
        MqttPackageHandler,
        "_handle_qos_2_publish_packet",
        ("self", "mid", "packet", "print_topic", "properties"),
    ),
    (MqttPackageHandler, "_handle_puback_packet", ("self", "cmd", "packet")),
    (MQTTConnection, "put_package", ("self", "pkg")),
    (MQTTConnection, "send_package", ("self", "package")),
    (MQTTConnection, "is_closing", ("self",)),
    (MQTTProtocol, "read", ("self", "n")),
    (MQTTProtocol, "_read_packet", ("self", "data")),
    (PersistentStorage, "push_message", ("self", "mid", "raw_package")),
    (PersistentStorage, "remove_message_by_mid", ("self", "mid")),
    (PersistentStorage, "clear", ("self",)),
)
# (class, function, names its code must use): instance attributes we read or
# write are assigned in __init__; gmqtt's own code must still use what we set.
_USES: Final = (
    (gmqtt.Client, "__init__", ("_package_handler",)),
    (MqttPackageHandler, "__init__", ("_reconnect_callback", "_connection_state", "_handler_cache")),
    (MqttPackageHandler, "_handle_disconnect_packet", ("_reconnect_callback",)),
    (
        MqttPackageHandler,
        "_handle_publish_packet",
        ("_handle_qos_1_publish_packet", "_handle_qos_2_publish_packet"),
    ),
    (MqttPackageHandler, "__get_handler__", ("getattr", "_handler_cache")),
    (MQTTConnection, "__init__", ("_protocol", "_last_data_in", "_handler")),
    (MQTTConnection, "put_package", ("_handler", "current_connection", "_last_data_in")),
    (MQTTConnection, "_keep_connection", ("_last_data_in",)),
    (MQTTProtocol, "_read_loop", ("read", "_read_packet")),
    (MQTTProtocol, "_read_packet", ("_connection", "put_package", "Package")),
    (gmqtt.Client, "publish", ("_persistent_storage", "push_message")),
    (gmqtt.Client, "_remove_message_from_queue", ("_persistent_storage", "remove_message_by_mid")),
    (gmqtt.Client, "_clear_resend_qos_queue", ("_persistent_storage", "clear")),
    (MQTTConnectError, "__init__", ("_code",)),
)


def problems() -> list[str]:
    """Every difference between the installed gmqtt and what the hooks need."""
    out: list[str] = []
    for cls, name, params in _SIGNATURES:
        fn = getattr(cls, name, None)
        if not callable(fn):
            out.append(f"{cls.__name__}.{name} is missing")
            continue
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            out.append(f"{cls.__name__}.{name}{got} no longer takes {params}")
    for cls, name, names in _USES:
        fn = getattr(cls, name, None)
        code = getattr(fn, "__code__", None)
        if code is None:
            out.append(f"{cls.__name__}.{name} is missing")
            continue
        for attr in names:
            if attr not in code.co_names:
                out.append(f"{cls.__name__}.{name} no longer uses {attr!r}")
    dispatch = getattr(MqttPackageHandler, "__get_handler__", None)
    if "_handle_{}_packet" not in getattr(getattr(dispatch, "__code__", None), "co_consts", ()):
        out.append("MqttPackageHandler.__get_handler__ no longer finds handlers as '_handle_{}_packet'")
    if not isinstance(getattr(MqttPackageHandler, "current_connection", None), property):
        out.append("MqttPackageHandler.current_connection is missing")
    return out


@cache
def check_gmqtt() -> None:
    """Raise GmqttInternalsChanged naming every problem (checked once per process)."""
    found = problems()
    if found:
        raise GmqttInternalsChanged(
            f"gmqtt {getattr(gmqtt, '__version__', '?')} is not the gmqtt the agent's hooks were written "
            f"for ({GMQTT_TESTED}): " + "; ".join(found)
        )
    if getattr(gmqtt, "__version__", None) != GMQTT_TESTED:
        log.warning(
            "gmqtt %s: the hooks were written for %s; their checks pass",
            getattr(gmqtt, "__version__", "?"),
            GMQTT_TESTED,
        )


def _require(obj: Any, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise GmqttInternalsChanged(f"gmqtt {type(obj).__name__} has no {', '.join(missing)}")


def _handler(client: gmqtt.Client) -> Any:
    check_gmqtt()
    handler = getattr(client, "_package_handler", None)
    if not isinstance(handler, MqttPackageHandler):
        raise GmqttInternalsChanged("gmqtt Client has no _package_handler")
    return handler


def _not_dispatched_yet(handler: Any) -> None:
    _require(handler, "_handler_cache")
    if handler._handler_cache:  # noqa: SLF001 - a cached dispatch would skip a replaced handler
        raise GmqttInternalsChanged(
            "gmqtt already dispatched packets: hooks must be installed before connect"
        )


# -- hooks -------------------------------------------------------------------------


def own_reconnect(client: gmqtt.Client, on_lost: Callable[[], None]) -> None:
    """Switch gmqtt's own reconnect off: `on_lost` is called instead, and the
    caller reconnects (with backoff, on a fresh client)."""
    handler = _handler(client)
    _require(handler, "_reconnect_callback")

    async def lost(delay: bool = False) -> None:
        on_lost()

    handler._reconnect_callback = lost  # noqa: SLF001 - gmqtt has no option to switch it off


def install_publish_hooks(client: gmqtt.Client, sink: PublishSink) -> None:
    """Before connect: hand every PUBLISH to `sink` (QoS0 with properties still
    reaches the public `on_message`).  Runs inside the same guard as the
    shortcut, so an error closes the connection instead of being logged away."""
    handler = _handler(client)
    _require(handler, "_handle_publish_packet", "_connection_state")
    _not_dispatched_yet(handler)
    general: Callable[[int, bytes], None] = handler._handle_publish_packet  # noqa: SLF001 - see module doc
    state = handler._connection_state  # noqa: SLF001 - the negotiated protocol version
    _require(state, "protocol_version")

    def on_publish(cmd: int, body: bytes) -> None:
        conn = handler.current_connection
        try:
            if not sink.raw_publish(conn, cmd, body, state.protocol_version >= MQTTv50):
                general(cmd, body)
        except Exception as e:  # noqa: BLE001 - this stands in for gmqtt's guard; the sink closes the session
            sink.hook_error(e)

    def parsed(qos: int) -> Callable[[int, bytes, str | bytes, dict[str, Any]], None]:
        def handle(mid: int, payload: bytes, topic: str | bytes, props: dict[str, Any]) -> None:
            sink.parsed_publish(handler.current_connection, qos, mid, topic, payload, props)

        return handle

    handler._handle_publish_packet = on_publish  # noqa: SLF001 - see module doc
    handler._handle_qos_1_publish_packet = parsed(1)  # noqa: SLF001 - non-optimistic ack without a task
    handler._handle_qos_2_publish_packet = parsed(2)  # noqa: SLF001 - likewise for PUBREC


def install_connection_hooks(client: gmqtt.Client, throttle: Callable[[], Awaitable[object] | None]) -> None:
    """After connect, on the live connection: PUBLISH packets skip gmqtt's
    dispatch (straight to the hook `install_publish_hooks` set), and each read
    of the socket first awaits `throttle()` when it returns an awaitable."""
    handler = _handler(client)
    if not installed(client)["publish"]:
        raise RuntimeError("install_publish_hooks() must come first: the shortcut bypasses gmqtt's guard")
    conn = handler.current_connection
    if conn is None:
        raise GmqttInternalsChanged("gmqtt has no current connection after connect")
    _require(conn, "_protocol", "_last_data_in", "put_package")
    protocol = conn._protocol  # noqa: SLF001 - its `read` is where backpressure can wait
    _require(protocol, "read")
    _require(protocol, "_read_packet")
    on_publish: Callable[[int, bytes], None] = handler._handle_publish_packet  # noqa: SLF001
    usual = conn.put_package
    original_read = protocol.read
    usual_frames: Callable[[bytes], int] = protocol._read_packet  # noqa: SLF001 - see read_packets

    def put_package(pkg: Any) -> None:
        if pkg.cmd & 0xF0 == PUBLISH and handler.current_connection is conn:
            on_publish(pkg.cmd, pkg.data)  # guarded inside
        else:
            usual(pkg)

    async def read(n: int = -1) -> bytes:
        wait = throttle()
        if wait is not None:
            await wait
        data: bytes = await original_read(n)
        # gmqtt's keepalive reads it (checked); once per read, not per packet
        conn._last_data_in = time.monotonic()  # noqa: SLF001
        return data

    def read_packets(data: bytes) -> int:
        """gmqtt's framing (`MQTTProtocol._read_packet`: the bytes of whole
        packets taken, -1 for a malformed length), with each PUBLISH handed
        straight to the hook: no `Package` and no `put_package` call per
        message (6 % of ingest's main thread).  Other packets go gmqtt's way."""
        if handler.current_connection is not conn:
            return usual_frames(data)  # superseded: gmqtt drops what it delivers
        pos, size = 0, len(data)
        while size - pos >= 2:
            length = data[pos + 1]
            start = pos + 2
            if length & 0x80:  # a longer Remaining Length (1.5.5), read step by step as gmqtt does
                length, mult = 0, 1
                start = pos + 1
                while True:
                    if start >= size:
                        return pos
                    byte = data[start]
                    length += (byte & 0x7F) * mult
                    if mult > 2097152:
                        return -1
                    mult *= 128
                    start += 1
                    if start + length > size or not byte & 0x80:
                        break
            end = start + length
            if end > size:
                break
            cmd = data[pos]
            if cmd & 0xF0 == PUBLISH:
                on_publish(cmd, data[start:end])  # guarded inside
            else:
                usual(Package(cmd, data[start:end]))
            pos = end
        return pos

    conn.put_package = put_package
    protocol.read = read
    protocol._read_packet = read_packets  # noqa: SLF001 - gmqtt's read loop calls it (checked)


def installed(client: gmqtt.Client) -> dict[str, bool]:
    """Which hooks are in place on `client` (for the canary test and doctor)."""
    handler = _handler(client)
    conn = handler.current_connection
    mine = vars(handler)
    return {
        "reconnect": getattr(mine.get("_reconnect_callback"), "__qualname__", "").startswith("own_reconnect"),
        "publish": getattr(mine.get("_handle_publish_packet"), "__qualname__", "").startswith(
            "install_publish_hooks"
        ),
        "qos1": "_handle_qos_1_publish_packet" in mine,
        "qos2": "_handle_qos_2_publish_packet" in mine,
        "shortcut": conn is not None and "put_package" in vars(conn),
        "throttle": conn is not None and "read" in vars(getattr(conn, "_protocol", object())),
        "framing": conn is not None and "_read_packet" in vars(getattr(conn, "_protocol", object())),
    }


def write(conn: Connection, data: bytes) -> None:
    """One socket write on `conn` (skipped when it has closed: the broker
    redelivers whatever those bytes would have acknowledged)."""
    if conn is not None and data and not conn.is_closing():
        conn.send_package(data)


def on_puback(client: gmqtt.Client, seen: Callable[[int, int], None]) -> None:
    """Call `seen(packet id, reason code)` for every PUBACK, before gmqtt's own
    handler frees the packet id."""
    handler = _handler(client)
    _require(handler, "_handle_puback_packet")
    _not_dispatched_yet(handler)
    original: Callable[[int, bytes], None] = handler._handle_puback_packet  # noqa: SLF001

    def handle(cmd: int, body: bytes) -> None:
        if len(body) >= 2:
            seen(*parse_ack(body))
        original(cmd, body)

    handler._handle_puback_packet = handle  # noqa: SLF001 - gmqtt 0.8 drops the reason code


def refusal_code(exc: MQTTConnectError) -> int | None:
    """The CONNACK reason code of a refused connect (MQTTConnectError keeps it private)."""
    check_gmqtt()
    code = getattr(exc, "_code", None)
    return code if isinstance(code, int) else None
