"""Doctor's Iggy checks (kind = "iggy" only):

* iggy            reachability of every node (``iggy nodes`` when several
                  are configured), login, the cluster's leader as the server
                  tells it (``iggy cluster``), the topics the routes need and
                  the user's permissions to send / create / poll
* iggy-transport  the Iggy password does not go in clear to another host
"""

from __future__ import annotations

import asyncio
from typing import Any

from ...checks import DEFAULT_ENV_FILE, LOCAL_HOSTS, TIMEOUT_S, Check, Status, tcp_problem
from ...config import IggySettings, Settings
from ...downlink.commands import return_topic
from ..protocol import UplinkError, UplinkRejected
from .errors import IGGY_SDK_VERSION, IncompatibleServer, is_unauthorized
from .probe import IggyProbe


async def check_iggy(settings: Settings, timeout: float = TIMEOUT_S) -> list[Check]:
    s = settings.iggy
    if s.kind != "iggy":
        note = {
            "none": "no uplink configured: records stay in the local buffer",
            "file": f"records go to the file {s.file_path} (debugging)",
            "memory": "in-memory uplink (tests only)",
        }[s.kind]
        status: Status = "warn" if s.kind in ("none", "memory") else "skip"
        return [
            Check(
                "iggy",
                status,
                f"kind = {s.kind!r}: {note}",
                'set [iggy] kind = "iggy" and address' if status == "warn" else "",
            )
        ]
    checks, reachable = await _iggy_nodes(s, timeout)
    if not reachable:
        return checks
    # Log in through the first reachable node (the probe moves on by itself
    # when one fails, as the agent does).
    s = s.model_copy(update={"addresses": tuple(reachable)})
    probe = IggyProbe(s, timeout_s=timeout)
    try:
        try:
            await probe.login()
        except UplinkError as e:
            text = str(e).lower()
            if isinstance(e, IncompatibleServer):
                fix = (
                    f"run iggy-server 0.9.x for this agent (apache-iggy {IGGY_SDK_VERSION}), "
                    "or an iggy-edge release made for that server"
                )
            elif "credential" in text or "unauthenticated" in text or "invalid" in text or "password" in text:
                fix = (
                    f"check iggy.username ({s.username!r}) and IGGY_PASSWORD in {DEFAULT_ENV_FILE} "
                    "(or the credentials_file)"
                )
            elif s.tls:
                fix = "check iggy.tls_ca_file / tls_domain against the server's certificate"
            else:
                fix = "is it an Iggy TCP endpoint (default port 8090)? does the server need TLS (IGGY_TLS)?"
            said = f"login to {s.where} as {s.username!r} failed: {e}"
            if s.password is None and not isinstance(e, IncompatibleServer):
                said = (
                    f"login to {s.where} as {s.username!r} failed: no password is set (the server said: {e})"
                )
                fix = (
                    f"set IGGY_PASSWORD in {DEFAULT_ENV_FILE} (or [iggy] password in the credentials_file); "
                    "never in the main config file"
                )
            return [*checks, Check("iggy", "fail", said, fix)]
        checks.append(Check("iggy", "ok", f"{probe.node}: logged in as {s.username!r}"))
        if len(settings.iggy.nodes) > 1:
            checks.append(await _iggy_leader(probe))
        checks.append(await _iggy_permissions(settings, probe))
        return checks
    finally:
        await probe.close()


async def _iggy_nodes(s: IggySettings, timeout: float) -> tuple[list[Check], list[str]]:
    """A TCP connect to every configured node (at once): the reachable ones,
    and a check saying which are (only when some are not, or several are
    configured)."""

    async def reach(address: str) -> str | None:
        host, _, port = address.rpartition(":")
        return await asyncio.to_thread(tcp_problem, host, int(port), timeout)

    problems = await asyncio.gather(*(reach(a) for a in s.nodes))
    reachable = [a for a, p in zip(s.nodes, problems, strict=True) if p is None]
    down = [f"{a} ({p})" for a, p in zip(s.nodes, problems, strict=True) if p is not None]
    fix = (
        "check iggy.address / iggy.addresses (IGGY_ADDRESS), the server, DNS and the firewall; the agent "
        "keeps buffering meanwhile"
    )
    if not reachable:
        return [Check("iggy", "fail", f"cannot reach {'; '.join(down)}", fix)], []
    if len(s.nodes) == 1:
        return [], reachable
    detail = f"{len(reachable)} of {len(s.nodes)} reachable: {', '.join(reachable)}"
    if down:
        return [Check("iggy nodes", "warn", f"{detail}; unreachable: {'; '.join(down)}", fix)], reachable
    return [Check("iggy nodes", "ok", detail)], reachable


async def _iggy_leader(probe: IggyProbe) -> Check:
    """Which node leads, as the node we logged in to tells it."""
    try:
        meta = await probe.cluster()
    except UplinkError as e:
        return Check("iggy cluster", "skip", f"the server does not tell its cluster's leader: {e}")
    leader = meta.leader
    nodes = ", ".join(f"{n.name} {n.address} {n.role} {n.status}" for n in meta.nodes)
    if leader is None:
        return Check(
            "iggy cluster",
            "warn",
            f"cluster {meta.name!r} names no leader (an election under way?): {nodes}",
            "run doctor again in a few seconds; if it persists, check the cluster's logs",
        )
    return Check(
        "iggy cluster", "ok", f"cluster {meta.name!r}, leader {leader.name} ({leader.address}); {nodes}"
    )


async def _iggy_permissions(settings: Settings, probe: IggyProbe) -> Check:
    """Which streams/topics exist, and whether the user may send, create and poll."""
    s = settings.iggy
    send_to = sorted({(r.stream, r.topic) for r in settings.routes})
    poll_from: list[tuple[str, str]] = []
    if settings.downlink.enabled:
        # the agent's own names for them, so doctor cannot drift from it
        rt = return_topic(settings)
        poll_from = [(rt.stream, rt.topic)]
    missing: list[str] = []
    try:
        for stream, topic in send_to + poll_from:
            try:
                if await probe.topic(stream, topic) is None:
                    missing.append(f"{stream}/{topic}")
            except UplinkRejected as e:
                if not is_unauthorized(e):
                    raise  # a send-only topic (provision-gateway's user) is there but not readable
        try:
            user = await probe.user(s.username)
        except UplinkRejected as e:
            if not is_unauthorized(e):
                raise
            return _least_privileged(s.username, missing)
    except UplinkError as e:
        return Check(
            "iggy permissions",
            "fail",
            f"cannot read streams/topics: {e}",
            f"grant {s.username!r} read_streams/read_topics, send_messages on the route streams and "
            "poll_messages on the downlink stream",
        )
    if missing and not s.create_missing:
        return Check(
            "iggy permissions",
            "fail",
            f"missing topics: {', '.join(missing)} and iggy.create_missing is off",
            f"create {', '.join(missing)} on the server (iggy topic create <stream> <topic> ...), "
            "or set iggy.create_missing = true",
        )
    perms = None if user is None else user.permissions
    if perms is None:
        note = "user has no explicit permission set (root?)" if user is not None else "cannot read own user"
        return Check(
            "iggy permissions",
            "warn" if user is None else "ok",
            note + (f"; will create {', '.join(missing)}" if missing else ""),
            "" if user is not None else f"give {s.username!r} read_users to let doctor verify permissions",
        )
    g = perms.global_permissions
    streams = perms.streams or {}
    needs: list[str] = []

    async def stream_perm(stream: str) -> Any:
        try:
            details = await probe.stream(stream)
        except UplinkRejected as e:
            if not is_unauthorized(e):
                raise
            raise _NotReadable from e
        return None if details is None else streams.get(details.id)

    try:
        for stream, _topic in send_to:
            sp = await stream_perm(stream)
            if not (
                g.send_messages
                or g.manage_streams
                or (sp is not None and (sp.send_messages or sp.manage_stream))
            ):
                needs.append(f"send_messages on stream {stream}")
        if missing and not (g.manage_streams or g.manage_topics):
            needs.append(f"manage_topics (or manage_streams) to create {', '.join(missing)}")
        for stream, _topic in poll_from:
            sp = await stream_perm(stream)
            if not (
                g.poll_messages
                or g.manage_streams
                or (sp is not None and (sp.poll_messages or sp.manage_stream))
            ):
                needs.append(f"poll_messages on stream {stream} (commands/config)")
    except _NotReadable:
        return _least_privileged(s.username, missing)
    if needs:
        return Check(
            "iggy permissions",
            "fail",
            f"{s.username!r} lacks: " + "; ".join(needs),
            "grant them with the Iggy CLI or web UI (iggy user permissions ...)",
        )
    extra = f"; will create {', '.join(missing)}" if missing else ""
    return Check("iggy permissions", "ok", "may send to the route topics and poll commands" + extra)


class _NotReadable(Exception):
    """The user may not read a stream's details: its grants cannot be matched to names."""


def _least_privileged(username: str, missing: list[str]) -> Check:
    """A user that may not read streams (what `iggy-edge cloud provision-gateway`
    makes): its grants, per stream and topic id, cannot be matched to names,
    so only the topics' presence is checked."""
    if missing:
        return Check(
            "iggy permissions",
            "fail",
            f"missing topics: {', '.join(missing)}; {username!r} may not create them",
            "provision the gateway from the cloud side: iggy-edge cloud provision-gateway --gateway <id>",
        )
    return Check(
        "iggy permissions",
        "ok",
        f"{username!r} is a least-privileged user (it may not read streams, so its grants per topic"
        " cannot be matched here): its topics are there",
    )


def check_iggy_transport(settings: Settings) -> Check | None:
    """The Iggy login (user name and password) in clear to a remote node."""
    s = settings.iggy
    if s.kind != "iggy":
        return None
    remote = [a for a in s.nodes if a.rpartition(":")[0] not in LOCAL_HOSTS | {"[::1]"}]
    if s.tls or not remote:
        how = "TLS" if s.tls else "loopback only"
        return Check("iggy-transport", "ok", f"{how}: the Iggy password does not cross the network in clear")
    return Check(
        "iggy-transport",
        "warn",
        f"iggy.tls is off: the password of {s.username!r} goes in clear to {', '.join(remote)}",
        "enable TLS on the Iggy server and set iggy.tls = true (with tls_ca_file / tls_domain)",
    )
