"""One logged-in apache-iggy client per direction, every call bounded.

Connection settings
    We build a `TcpConfig` rather than a connection string: the string form
    (``iggy+tcp://user:pass@host:port?tls=true&tls_domain=..&tls_ca_file=..``)
    is split on ``@``, ``:`` and ``&`` with no percent-decoding, so a password
    containing one of them cannot be expressed.  `TcpConfig` takes
    ``tls_enabled``, ``tls_domain`` (None or empty = taken from the address)
    and ``tls_ca_file``; the certificate is validated by default (no CA file
    means the system roots).  A failed TLS handshake (unknown CA, wrong name)
    and plain TCP against a TLS port look like a down server ("Cannot
    establish connection" / "Disconnected"); a missing CA file is "Invalid
    TLS certificate path".

Bounded calls
    By default the SDK reconnects forever, and with auto-login it *replays the
    request* after reconnecting, under a new session -- a send could be stored
    twice without us knowing.  We therefore turn auto-login off (we log in
    ourselves), turn SDK reconnection off entirely, and wrap every call in
    `timeouts.wait_for`.  ``max_retries=0`` is not enough: the SDK still makes
    one redial inside the awaited request, after the ``reestablish_after``
    cooldown (5 s), so a send to a stopped server hung for 5 s and then said
    "Cannot establish connection" although it may have been written.  With
    reconnection off it fails at once with "Disconnected".  After any
    failure other than a server answer the client is dropped and the next
    call builds a fresh one.  One client per direction (uplink, command
    source, sink, probe): the server handles one request at a time per
    connection.  A connected client still referenced at interpreter exit can
    abort the process (SIGABRT, SDK 0.9.0), so `close()` logs out and lets go
    of it.

Several nodes
    With ``addresses`` (the nodes of one cluster) the connection uses one node
    at a time.  When connecting to it fails, the next node is tried at once
    (each within ``connect_timeout_s``), once per node and call; when all fail
    the call raises `UplinkUnavailable` and the caller's capped, jittered
    backoff applies.  After a call on an established client fails without a
    server answer (lost connection, no answer in time), the next connect
    starts at the *next* node: a node that stopped answering is left for
    another, while a node that answered with an error stays.  Nothing about
    ambiguity changes: a batch that may have been written is re-sent with
    the same message ids, to whichever node is in use.  The SDK 0.9 client
    finds the cluster's leader after login by itself (it redirects), but
    cannot leave a node that is gone, hence this.

What a connection costs the server (issue 23, docs/scaling.md)
    * A login: with ``token`` set (a personal access token) the client logs
      in with it on connect (``AutoLogin.personal_access_token``; with SDK
      reconnection off nothing is ever replayed): the server hashes the token
      and looks it up.  A password login is an Argon2 verification on the
      server's shard thread, which answers nothing else meanwhile.
    * A heartbeat every ``heartbeat_interval_s`` (the SDK pings on its own
      task whatever else the connection carries; the server counts any
      request as liveness and evicts a silent client only if it is in a
      consumer group, which ours never are).  60 s instead of the SDK's
      5 s: a ping a minute keeps an idle connection (return path off) known
      to NATs and firewalls.  On the agent's shared connection the return
      poll makes a request every ``poll_interval_s`` anyway, so there the
      SDK pings only once an hour (``heartbeat_s``, `POLLED_HEARTBEAT_S`,
      uplink/factory.py): at rest a gateway's one request a second is its
      poll, nothing else (the fleet's ``requests_at_rest_per_gateway``).
    * One connection can carry several callers at once: the SDK takes the
      socket for one request and its answer at a time (lockstep), so
      concurrent calls queue in order instead of interleaving.  The agent
      shares one connection between the uplink and the return path
      (factory.py).
    * ``start_jitter`` (the agent's shared connection only): the first
      connect waits a random 0..start_jitter seconds, so a fleet starting
      together spreads its logins.
    * One attempt: callers that were waiting for the lock while a connect
      failed get that failure, and each backs off (forward, return poll)
      instead of starting a login of its own the moment the first gave up.
      A busy cluster answers a login "transient"; the SDK replays it every
      50 ms on the same connection (core/sdk tcp_client.rs) until our
      `connect_timeout_s`, so every extra attempt is some 20 logins a second
      more for the metadata primary (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Final, TypeVar

from apache_iggy import AutoLogin, IggyClient, TcpConfig, TcpReconnectionConfig

from ...config import IggySettings
from ...timeouts import wait_for
from ..protocol import UplinkAmbiguous, UplinkError, UplinkRejected, UplinkUnavailable
from .errors import IncompatibleServer, classify, protocol_mismatch

log = logging.getLogger(__name__)

# An apache-iggy 0.9 client left in a reference cycle is freed only during
# interpreter finalization, and freeing it then aborts the process (SIGABRT,
# about 1 run in 10 of a one-shot CLI command here, after its work was done).
# Collecting before finalization frees it while the runtime is still whole:
# 0 aborts in 60 runs (see the commit that added this).
atexit.register(gc.collect)

T = TypeVar("T")

# Two ways a server of another release shows itself at login (both checked
# with a real SDK 0.9.0 client, tests/test_uplink_versions.py):
# * a server that frames requests as SDK 0.9.0 does (256-byte VSR headers)
#   but speaks another binary-protocol version answers the login with an
#   Eviction frame naming the versions it accepts; the SDK says "Incompatible
#   binary protocol version" and we raise IncompatibleServer with both
#   versions (errors.protocol_mismatch);
# * anything else -- a server framing requests otherwise (iggy-server 0.8's
#   8-byte frames), a TLS-only port, an endpoint that closes, answers junk or
#   stays silent -- gives "Disconnected" or a timeout, exactly what a server
#   dying mid-login would give, so PROTOCOL_HINT is a hint, not a verdict.
PROTOCOL_HINT: Final = (
    "the server accepted the connection but did not answer the login in the protocol "
    "apache-iggy 0.9 speaks: is it iggy-server 0.9.x on its TCP port? A server of another "
    "Iggy release can frame requests otherwise, and a TLS-only port (iggy.tls) does the same"
)

# Builds the SDK client from its config; tests substitute a fake.
ClientFactory = Callable[[TcpConfig], IggyClient]


class Connection:
    """One logged-in SDK client, rebuilt after any failure.

    Every call goes through `call`, bounded by `request_timeout_s`; `client`
    connects and logs in within `connect_timeout_s`.
    """

    def __init__(
        self,
        settings: IggySettings,
        role: str,
        client_factory: ClientFactory | None = None,
        *,
        start_jitter: float = 0.0,
        heartbeat_s: float | None = None,
    ) -> None:
        self.settings = settings
        # The SDK's ping interval: ``heartbeat_interval_s`` unless the owner
        # knows the connection is never idle that long (module docstring).
        self.heartbeat_s = settings.heartbeat_interval_s if heartbeat_s is None else heartbeat_s
        self.role = role
        self._factory: ClientFactory = client_factory or IggyClient
        self._client: IggyClient | None = None
        self._lock = asyncio.Lock()
        self._nodes = settings.nodes
        self._next = 0  # index of the node the next connect starts with
        self.node: str | None = None  # the node of the current client
        self._start_jitter = start_jitter  # spent by the first connect (module docstring)
        self.connects = 0  # clients built (each a login), for the fleet bench
        self._holders = 1  # users that will each close() it (`share`)
        self._attempts = 0  # connect attempts ended (`client`)
        self._failed: UplinkError | None = None  # how the last one ended, if it failed

    def share(self) -> Connection:
        """This connection, for one more user: `close` logs out only when
        the last of them closes it."""
        self._holders += 1
        return self

    def prefer(self, address: str) -> None:
        """Start the next connect at `address` (one the recovery probe found
        reachable); ignored for an unknown address or while connected."""
        if self._client is None and address in self._nodes:
            self._next = self._nodes.index(address)

    def _tcp_config(self, address: str) -> TcpConfig:
        s = self.settings
        return TcpConfig(
            server_address=address,
            # A token logs in on connect (nothing is replayed: reconnection
            # is off); a password is sent by `_connect` after connecting.
            auto_login=(
                AutoLogin.personal_access_token(s.token.get_secret_value())
                if s.token is not None
                else AutoLogin.disabled()
            ),
            heartbeat_interval=timedelta(seconds=self.heartbeat_s),
            # No SDK reconnection at all: a lost connection fails the request
            # at once ("Disconnected") and we build a fresh client on the next
            # call.  Checked against server 0.9.0-edge.5: even with
            # max_retries=0 the SDK first waits out `reestablish_after` (5 s)
            # inside the awaited request, then redials and would re-send the
            # request on a new, unauthenticated session.
            reconnection=TcpReconnectionConfig(enabled=False),
            tls_enabled=s.tls,
            tls_domain=s.tls_domain,
            tls_ca_file=str(s.tls_ca_file) if s.tls_ca_file is not None else None,
            nodelay=True,
        )

    async def client(self) -> IggyClient:
        if self._client is not None:
            return self._client
        attempt = self._attempts
        async with self._lock:
            if self._client is not None:
                return self._client
            if self._attempts != attempt and self._failed is not None:
                # A connect ran while this caller waited for the lock and
                # failed: share its outcome (module docstring, "One attempt").
                raise self._failed
            try:
                client = await self._dial()
            except UplinkError as e:
                self._failed = e
                raise
            else:
                self._failed = None
            finally:
                self._attempts += 1
            return client

    async def _dial(self) -> IggyClient:
        """Connect to the first node that takes us (the jitter first)."""
        if self._start_jitter > 0:
            jitter, self._start_jitter = random.uniform(0, self._start_jitter), 0.0  # noqa: S311
            log.info("iggy %s: first connect in %.1fs (start_jitter_s)", self.role, jitter)
            await asyncio.sleep(jitter)
        problems: list[str] = []
        first_error: UplinkError | None = None
        n = len(self._nodes)
        for i in range(n):
            index = (self._next + i) % n
            address = self._nodes[index]
            try:
                client = await self._connect(address)
            except UplinkRejected:
                raise  # bad settings: no other node will take them either
            except UplinkUnavailable as e:
                problems.append(str(e))
                first_error = first_error or e
                continue
            self._next = index
            self._client = client
            self.node = address
            return client
        if n == 1 and first_error is not None:
            raise first_error
        raise UplinkUnavailable(f"iggy {self.role}: no node answered: " + "; ".join(problems))

    async def _connect(self, address: str) -> IggyClient:
        s = self.settings
        password = s.password.get_secret_value() if s.password is not None else ""
        try:
            client = self._factory(self._tcp_config(address))
        except (ValueError, RuntimeError) as e:
            raise UplinkRejected(f"iggy {self.role}: bad connection settings: {e}") from e
        deadline = time.monotonic() + s.connect_timeout_s
        connected = False
        who = "with a token" if s.token is not None else f"as {s.username!r}"
        self.connects += 1
        try:
            await wait_for(client.connect(), s.connect_timeout_s)  # and the token login, if any
            connected = True
            if s.token is None:
                remaining = max(0.001, deadline - time.monotonic())
                await wait_for(client.login_user(s.username, password), remaining)
        except TimeoutError as e:
            raise UplinkUnavailable(
                f"iggy {self.role}: no connection to {address} within {s.connect_timeout_s}s"
                + (f" ({PROTOCOL_HINT})" if connected else "")
            ) from e
        except (RuntimeError, OSError) as e:
            mismatch = protocol_mismatch(e, address)
            if mismatch is not None:
                raise IncompatibleServer(f"iggy {self.role}: {mismatch}") from e
            hint = f" ({PROTOCOL_HINT})" if connected and "disconnected" in str(e).lower() else ""
            raise UplinkUnavailable(
                f"iggy {self.role}: cannot connect/log in to {address} {who}: {e}{hint}"
            ) from e
        log.info("iggy %s connected to %s %s", self.role, address, who)
        return client

    def drop(self) -> None:
        """Forget the client; its connection closes when the object is freed
        (dropping it also stops its heartbeat task).  The next connect starts
        at the next node."""
        if self._client is not None:
            self._next = (self._next + 1) % len(self._nodes)
        self._client = None
        self.node = None

    async def reachable(self, timeout: float) -> str | None:
        """The first node (in order, starting at the preferred one) that
        accepts a TCP connection within `timeout`, or None.  One connect per
        node, all at once, closed at once: the cheap look the forwarder's
        recovery probe takes while the uplink is down."""
        return await first_reachable(self._nodes[self._next :] + self._nodes[: self._next], timeout)

    async def call(
        self,
        what: str,
        awaitable: Awaitable[T],
        *,
        confirmed: frozenset[int] = frozenset(),
        timeout: float | None = None,
    ) -> T:
        """Await one SDK call, bounded; map failures to UplinkError and drop
        the client so the next call reconnects."""
        timeout = self.settings.request_timeout_s if timeout is None else timeout
        try:
            return await wait_for(awaitable, timeout)
        except TimeoutError as e:
            self.drop()
            raise UplinkAmbiguous(
                f"iggy {self.role}: {what}: no answer within {timeout}s", confirmed=confirmed
            ) from e
        except (RuntimeError, OSError) as e:
            kind = classify(e)
            if kind is not UplinkRejected:
                self.drop()
            raise kind(f"iggy {self.role}: {what}: {e}", confirmed=confirmed) from e

    async def close(self) -> None:
        self._holders -= 1
        if self._holders > 0:
            return
        client, self._client = self._client, None
        if client is not None:
            try:
                await wait_for(client.logout_user(), 1.0)
            except (RuntimeError, OSError, TimeoutError) as e:
                log.debug("iggy %s logout on close failed: %s", self.role, e)


async def _tcp_open(address: str, timeout: float) -> bool:
    host, _, port = address.rpartition(":")
    try:
        _reader, writer = await wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def first_reachable(addresses: Sequence[str], timeout: float) -> str | None:
    """The first of `addresses` that accepts a TCP connection within
    `timeout` (all tried at once), or None."""
    results = await asyncio.gather(*(_tcp_open(a, timeout) for a in addresses))
    return next((a for a, ok in zip(addresses, results, strict=True) if ok), None)


CREATE_PERSONAL_ACCESS_TOKEN_CODE: Final = 42


async def create_personal_access_token(conn: Connection, name: str, expiry_s: int = 0) -> str:
    """A new personal access token of the user `conn` logs in as (the SDK 0.9
    Python client has no call for it): raw CREATE_PERSONAL_ACCESS_TOKEN, name
    (u8 length + bytes) and expiry in seconds (u64 LE, 0 = never); the answer
    is the token (u8 length + bytes).  The server keeps only its hash."""
    raw = name.encode()
    if not 1 <= len(raw) <= 255:
        raise ValueError(f"token name must be 1-255 bytes: {name!r}")
    client = await conn.client()
    payload = bytes((len(raw),)) + raw + expiry_s.to_bytes(8, "little")
    body = bytes(
        await conn.call(
            f"create token {name}", client.send_binary_request(CREATE_PERSONAL_ACCESS_TOKEN_CODE, payload)
        )
    )
    if not body or len(body) < 1 + body[0]:
        raise UplinkRejected(f"iggy {conn.role}: create token {name}: a malformed answer ({len(body)} bytes)")
    return body[1 : 1 + body[0]].decode()
