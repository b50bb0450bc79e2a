"""Provisioning a gateway from the cloud side, with admin Iggy credentials.

`provision_gateway` makes everything one gateway needs on the Iggy server,
so the gateway itself needs no right to create anything:

* the shared topics the gateway's routes send to (``edge/telemetry``,
  ``acks``, ``events`` by default), created as the agent would create them
  (``iggy.partitions`` partitions, persisted) when missing;
* its return-path topic (downlink/commands.py, "Addressing"): stream
  ``edge-rp-<n>``, topic ``return.<gateway>``, ONE partition, persisted;
* an Iggy user for the gateway with exactly these permissions, nothing
  global:

  =====================================  ====================================
  its return-path topic                  ``read_topic`` (the look at start,
                                         GET_TOPIC) and ``poll_messages``
                                         (polls, storing its consumer offset)
  each shared route topic                ``send_messages`` only: a gateway
                                         cannot read the fleet's telemetry
                                         (the uplink then takes the partition
                                         count from ``iggy.partitions``,
                                         uplink/iggy/topics.py)
  the two-topic scheme's topics of the   ``read_topic`` and ``poll_messages``,
  gateway, when they exist               so the upgraded agent can read out
                                         what is pending there (migration)
  =====================================  ====================================

  Iggy grants per stream and topic *id*, so another gateway's topic, created
  later, is not covered.  The user is made with a new random password; for
  a user that exists already the permissions are set again (the server
  replaces them whole) and the password is kept, unless `rotate` asks for a
  new one (the user is deleted and made again: its sessions end).

With the new password it also makes the user a personal access token
(logged in as the user once: a token belongs to the user that makes it), and
the gateway's credentials are the user name and that token: a token login
costs the server a hash look-up where a password login is an Argon2
verification, and a fleet logging in with passwords at once times out
(docs/scaling.md, "What a login costs").

`provision_gateways` does the same for many gateways in three passes (all
topics, then all users, then all tokens): far less memory on the server
than one gateway at a time (its docstring, docs/scaling.md).

Idempotent: running it again for the same gateway changes nothing but the
permissions it sets anyway.  It never deletes a topic.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from apache_iggy import IggyClient, Permissions, StreamPermissions, TopicPermissions
from pydantic import SecretStr

from ..config import Settings
from ..downlink.commands import ReturnTopic, legacy_topics, return_topic_of
from ..uplink.iggy.connection import Connection, create_personal_access_token
from ..uplink.iggy.errors import is_already_exists, is_not_found
from ..uplink.iggy.topics import create_topic, get_topic
from ..uplink.protocol import UplinkRejected

log = logging.getLogger(__name__)

MAX_USERNAME: Final = 50  # iggy-server's limit (3..50 bytes)
USER_PREFIX: Final = "gw-"
TOKEN_NAME: Final = "iggy-edge"  # noqa: S105 - the name of the gateway user's token, not a secret
PASSWORD_BYTES: Final = 24  # 32 URL-safe characters; the server takes 3..100
# Seconds from the start of one Argon2 step of `provision_gateways` (a user
# made, a token's login) to the next: at most 12 a second.  Back to back (33
# a second here) the metadata leader of a 3-node iggy-server 0.9.0-edge.5
# cluster missed its heartbeats during the tokens pass in 2 of 2 runs of
# 1,000 gateways, and the view change that followed left the partitions'
# primaries on another node than the one the clients then used (refused
# writes for minutes, docs/scaling.md, run E); one gateway at a time
# (about 15 steps a second) never did.
HASH_PACE_S: Final = 1 / 12


def gateway_username(gateway_id: str) -> str:
    """The gateway's Iggy user name: ``gw-<gateway id>``; an id too long for
    the server's 50 bytes is cut and ends in 8 hex digits of its hash."""
    name = USER_PREFIX + gateway_id
    if len(name) <= MAX_USERNAME:
        return name
    digest = hashlib.blake2b(gateway_id.encode(), digest_size=4).hexdigest()
    return name[: MAX_USERNAME - 9] + "-" + digest


@dataclass(frozen=True, slots=True)
class Provisioned:
    """What `provision_gateway` did, and the gateway's credential."""

    gateway_id: str
    username: str
    password: str | None  # None: the user existed and keeps its password
    return_stream: str
    return_topic: str
    created_topic: bool
    created_user: bool
    send_topics: list[str] = field(default_factory=list)
    legacy_topics: list[str] = field(default_factory=list)
    token: str | None = None  # the user's personal access token, made with its password

    def credentials_toml(self) -> str:
        """The ``[iggy]`` table of the gateway's credentials file
        (``credentials_file``, docs/config.md): the user name and its token
        (or, without one, its password)."""
        if self.password is None:
            raise ValueError("no password to write: the user existed (use rotate for a new one)")
        # A JSON string is a TOML basic string (ASCII only: ensure_ascii).
        secret = (
            f"token = {json.dumps(self.token)}" if self.token else f"password = {json.dumps(self.password)}"
        )
        return f"[iggy]\nusername = {json.dumps(self.username)}\n{secret}\n"

    def summary(self) -> dict[str, object]:
        """Everything but the password."""
        return {
            "gateway": self.gateway_id,
            "username": self.username,
            "return_stream": self.return_stream,
            "return_topic": self.return_topic,
            "created_topic": self.created_topic,
            "created_user": self.created_user,
            "new_password": self.password is not None,
            "send_topics": self.send_topics,
            "legacy_topics": self.legacy_topics,
        }


class _Grants:
    """Per-topic permissions being collected, by stream and topic id."""

    def __init__(self) -> None:
        self._topics: dict[int, dict[int, TopicPermissions]] = {}

    def add(self, stream_id: int, topic_id: int, **flags: bool) -> None:
        self._topics.setdefault(stream_id, {})[topic_id] = TopicPermissions(**flags)

    def copy(self) -> _Grants:
        other = _Grants()
        other._topics = {s: dict(t) for s, t in self._topics.items()}
        return other

    def permissions(self) -> Permissions:
        return Permissions(streams={s: StreamPermissions(topics=t) for s, t in self._topics.items()})


async def _ids(conn: Connection, client: IggyClient, stream: str, topic: str) -> tuple[int, int] | None:
    details = await get_topic(conn, client, stream, topic)
    if details is None:
        return None
    got = await conn.call(f"get stream {stream}", client.get_stream(stream))
    if got is None:
        return None
    return got.id, details.id


async def _user(
    conn: Connection, client: IggyClient, username: str, permissions: Permissions, rotate: bool
) -> tuple[str | None, bool]:
    """(new password or None, whether the user was created)."""
    existing = None
    try:
        existing = await conn.call(f"get user {username}", client.get_user(username))
    except UplinkRejected as e:
        if not is_not_found(e):
            raise
    if existing is not None and not rotate:
        await conn.call(f"set permissions of {username}", client.update_permissions(username, permissions))
        return None, False
    if existing is not None:
        await conn.call(f"delete user {username}", client.delete_user(username))
    password = secrets.token_urlsafe(PASSWORD_BYTES)
    try:
        await conn.call(
            f"create user {username}", client.create_user(username, password, permissions=permissions)
        )
    except UplinkRejected as e:
        if is_already_exists(e):  # made by someone else meanwhile
            raise UplinkRejected(f"iggy: user {username} appeared meanwhile; run again") from e
        raise
    return password, existing is None


async def _token(settings: Settings, username: str, password: str) -> str:
    """A personal access token of the new user, made logged in as it."""
    user = settings.iggy.model_copy(
        update={"username": username, "password": SecretStr(password), "token": None}
    )
    conn = Connection(user, "provisioning (token)")
    try:
        return await create_personal_access_token(conn, TOKEN_NAME)
    finally:
        await conn.close()


async def provision_gateway(
    settings: Settings,
    gateway_id: str,
    *,
    username: str | None = None,
    rotate: bool = False,
    tokens: bool = True,
    connection: Connection | None = None,
) -> Provisioned:
    """Provision `gateway_id` on the server `settings.iggy` names, logged in
    with its (admin) credentials; `settings` also gives the naming
    (``[downlink]``), the shared route topics and ``iggy.partitions``.
    `connection`: an admin connection of the caller's, kept open (many
    gateways, one admin login: each login is an Argon2 hash)."""
    name = username or gateway_username(gateway_id)
    done = await provision_gateways(
        settings, [(gateway_id, name)], rotate=rotate, tokens=tokens, connection=connection
    )
    return done[0]


async def provision_gateways(
    settings: Settings,
    gateways: Sequence[str | tuple[str, str]],
    *,
    rotate: bool = False,
    tokens: bool = True,
    connection: Connection | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    pace_s: float = HASH_PACE_S,
) -> list[Provisioned]:
    """`provision_gateway` for many gateways (ids, or (id, user name)
    pairs), in three passes: every topic, then every user, then every
    token.  The order is for the server: creating a user hashes its password
    (Argon2, 19 MiB of working memory) and a token is a login as the user,
    and iggy-server 0.9.0-edge.5 keeps memory when those alternate with
    topic creation -- about 17 MB on the leader per gateway provisioned one
    at a time (25 MB with its token), none for the same work in passes
    (docs/scaling.md, "Provisioning").  `progress(pass, done, total)` is
    called after each gateway of each pass.  The users and tokens passes
    start one step every `pace_s` seconds at most (`HASH_PACE_S`)."""
    todo = [(g, gateway_username(g)) if isinstance(g, str) else g for g in gateways]
    conn = connection or Connection(settings.iggy, "provisioning")
    tell = progress or (lambda _pass, _done, _total: None)
    try:
        client = await conn.client()
        shared = _Grants()
        sends: list[str] = []
        for stream, topic in sorted({(r.stream, r.topic) for r in settings.routes}):
            await create_topic(conn, client, stream, topic, settings.iggy.partitions)
            ids = await _ids(conn, client, stream, topic)
            if ids is None:
                raise UplinkRejected(f"iggy: {stream}/{topic} is missing right after creating it")
            shared.add(*ids, send_messages=True)
            sends.append(f"{stream}/{topic}")
        topics: list[tuple[_Grants, ReturnTopic, bool, list[str]]] = []
        for i, (gateway_id, _name) in enumerate(todo, 1):
            topics.append(await _gateway_topics(conn, client, settings, gateway_id, shared))
            tell("topics", i, len(todo))
        users: list[tuple[str | None, bool]] = []
        pace = _Pace(pace_s if len(todo) > 1 else 0.0)
        for i, ((_gw, name), (grants, _, _, _)) in enumerate(zip(todo, topics, strict=True), 1):
            await pace.step()
            users.append(await _user(conn, client, name, grants.permissions(), rotate))
            tell("users", i, len(todo))
        out: list[Provisioned] = []
        for i, ((gateway_id, name), (_, rt, created, legacy), (password, made)) in enumerate(
            zip(todo, topics, users, strict=True), 1
        ):
            token = None
            if password is not None and tokens:
                await pace.step()
                token = await _token(settings, name, password)
            log.info("provisioned gateway %s: user %s, %s/%s", gateway_id, name, rt.stream, rt.topic)
            out.append(
                Provisioned(
                    gateway_id, name, password, rt.stream, rt.topic, created, made, sends, legacy, token
                )
            )
            tell("tokens" if tokens else "done", i, len(todo))
        return out
    finally:
        if connection is None:
            await conn.close()


class _Pace:
    """At most one step every `interval` seconds (start to start)."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._next = 0.0

    async def step(self) -> None:
        now = time.monotonic()
        if now < self._next:
            await asyncio.sleep(self._next - now)
        self._next = max(now, self._next) + self._interval


async def _gateway_topics(
    conn: Connection, client: IggyClient, settings: Settings, gateway_id: str, shared: _Grants
) -> tuple[_Grants, ReturnTopic, bool, list[str]]:
    """The gateway's return-path topic (made if missing): its grants (the
    shared ones and its own), the topic, whether it was made, and the topics
    of the two-topic scheme it may read out."""
    grants = shared.copy()
    rt = return_topic_of(gateway_id, settings.downlink)
    created = await create_topic(conn, client, rt.stream, rt.topic, 1)
    ids = await _ids(conn, client, rt.stream, rt.topic)
    if ids is None:
        raise UplinkRejected(f"iggy: {rt.stream}/{rt.topic} is missing right after creating it")
    grants.add(*ids, read_topic=True, poll_messages=True)
    legacy: list[str] = []
    for topic in legacy_topics(gateway_id, settings.downlink):
        ids = await _ids(conn, client, settings.downlink.stream, topic)
        if ids is not None:
            grants.add(*ids, read_topic=True, poll_messages=True)
            legacy.append(f"{settings.downlink.stream}/{topic}")
    return grants, rt, created, legacy


async def create_return_topic(settings: Settings, gateway_id: str | None = None) -> bool:
    """Only the return-path topic of `gateway_id` (default: the settings'
    own), with `settings.iggy`'s login; whether it was created.  For a
    server that is its own cloud side (the demo's private one, benches)."""
    rt = return_topic_of(gateway_id or settings.gateway_id, settings.downlink)
    conn = Connection(settings.iggy, "provisioning")
    try:
        return await create_topic(conn, await conn.client(), rt.stream, rt.topic, 1)
    finally:
        await conn.close()
