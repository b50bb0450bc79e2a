"""A short, read-only look at an Iggy server, for diagnostics (`doctor`).

`IggyProbe` logs in with the agent's settings under its own connection (so
it never disturbs a running agent's), and answers the questions doctor asks:
does this topic / stream exist, what may this user do, which node leads.  It creates nothing,
every call is bounded by the probe's timeout, and every failure is an
`UplinkError` (classified like the agent's own calls, errors.py).
"""

from __future__ import annotations

from types import TracebackType

from apache_iggy import StreamDetails, TopicDetails, UserInfoDetails

from ...config import IggySettings
from ..protocol import UplinkRejected
from .cluster import GET_CLUSTER_METADATA_CODE, ClusterMetadata, decode_cluster_metadata
from .connection import ClientFactory, Connection
from .topics import get_topic


class IggyProbe:
    """``async with IggyProbe(settings, timeout_s=5) as probe:`` logs in (or
    raises UplinkUnavailable / UplinkRejected) and closes on exit."""

    def __init__(
        self, settings: IggySettings, *, timeout_s: float, client_factory: ClientFactory | None = None
    ) -> None:
        bounded = settings.model_copy(update={"connect_timeout_s": timeout_s, "request_timeout_s": timeout_s})
        self._conn = Connection(bounded, "probe", client_factory)

    async def login(self) -> None:
        """Connect and log in; raises UplinkError when that fails."""
        await self._conn.client()

    async def topic(self, stream: str, topic: str) -> TopicDetails | None:
        """The topic's details, or None when it or its stream is missing."""
        return await get_topic(self._conn, await self._conn.client(), stream, topic)

    async def stream(self, stream: str) -> StreamDetails | None:
        client = await self._conn.client()
        return await self._conn.call(f"get stream {stream}", client.get_stream(stream))

    async def user(self, username: str) -> UserInfoDetails | None:
        """The user's details (with its permissions), or None when the
        server does not tell (no such user, or no right to read users)."""
        client = await self._conn.client()
        return await self._conn.call("get user", client.get_user(username))

    async def cluster(self) -> ClusterMetadata:
        """The cluster's nodes and leader as this node tells them (a server
        outside cluster mode names itself alone)."""
        client = await self._conn.client()
        reply = await self._conn.call(
            "get cluster metadata", client.send_binary_request(GET_CLUSTER_METADATA_CODE, b"")
        )
        try:
            return decode_cluster_metadata(bytes(reply))
        except ValueError as e:
            raise UplinkRejected(f"iggy probe: {e}") from e

    @property
    def node(self) -> str | None:
        """The node this probe is logged in to."""
        return self._conn.node

    async def close(self) -> None:
        await self._conn.close()

    async def __aenter__(self) -> IggyProbe:
        try:
            await self.login()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
