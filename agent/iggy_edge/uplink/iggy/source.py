"""`CommandSource` over a real Iggy server: the return path's reads.

On poll, a message's ``timestamp()`` is the server's append time (what
`PolledMessage` carries).  Offsets are mirrored by offsets.py.

The source never creates a topic: the gateway's return-path topic is the
cloud side's to provision (cloud/provision.py), and the gateway's Iggy user
may not create one.  A poll of a missing topic is refused by the server
(`UplinkRejected`) and `last_offsets` says None.
"""

from __future__ import annotations

from apache_iggy import Consumer, PollingStrategy, ReceiveMessage

from ...config import IggySettings
from ..protocol import PolledMessage
from .connection import ClientFactory, Connection
from .offsets import get_consumer_offset, store_consumer_offset
from .topics import get_topic


def _headers_of(message: ReceiveMessage) -> dict[str, str]:
    raw = message.user_headers()
    if not raw:
        return {}
    out: dict[str, str] = {}
    for k, v in raw.to_scalar_dict().items():
        key = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        if isinstance(v, bytes):
            out[key] = v.decode(errors="replace")
        else:
            out[key] = str(v)
    return out


class IggyCommandSource:
    """`CommandSource` over a real Iggy server (its own connection).

    `poll` reads with a plain consumer (``Consumer.Single(consumer_name)``),
    ``PollingStrategy.Offset`` and no auto-commit: the server stores nothing
    when we poll.  `mirror_offset` stores the offset of that same consumer
    with a raw STORE_CONSUMER_OFFSET (offsets.py).
    """

    def __init__(
        self,
        settings: IggySettings,
        gateway_id: str,
        consumer_name: str,
        *,
        client_factory: ClientFactory | None = None,
        connection: Connection | None = None,  # the agent's, shared with the uplink (factory.py)
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self.consumer_name = consumer_name
        self._conn = connection or Connection(settings, "command source", client_factory)
        self.polls = 0  # requests, for the return path's load (bench/command_latency_bench.py)
        self.probes = 0

    async def start(self) -> None:
        await self._conn.client()

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        client = await self._conn.client()
        self.polls += 1
        messages = await self._conn.call(
            f"poll {stream}/{topic}/{partition_id} at {offset}",
            client.poll_messages(
                stream,
                topic,
                consumer=Consumer.Single(self.consumer_name),
                polling_strategy=PollingStrategy.Offset(offset),
                count=count,
                auto_commit=False,
                partition_id=partition_id,
            ),
        )
        return [
            PolledMessage(
                offset=m.offset(),
                message_id=m.id(),
                payload=m.payload(),
                headers=_headers_of(m),
                timestamp_us=m.timestamp(),
            )
            for m in messages
        ]

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        """From GET_TOPIC: its partitions' ``current_offset`` is the newest
        message's offset (0 also when the partition is empty, so
        ``messages_count`` tells the two apart)."""
        client = await self._conn.client()
        self.probes += 1
        details = await get_topic(self._conn, client, stream, topic)
        if details is None:
            return None
        return {p.id: p.current_offset if p.messages_count else -1 for p in details.partitions}

    async def reachable(self, timeout: float) -> bool:
        """Whether some node accepts a TCP connection now (the return poll's
        recovery probe, `probe.py`); the next connect starts at that node."""
        node = await self._conn.reachable(timeout)
        if node is not None:
            self._conn.prefer(node)
        return node is not None

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        await store_consumer_offset(self._conn, self.consumer_name, stream, topic, partition_id, offset)

    async def read_mirrored_offset(self, stream: str, topic: str, partition_id: int) -> int | None:
        """The offset the server holds for our consumer on this partition (what
        the cloud side sees), or None when none was stored."""
        return await get_consumer_offset(self._conn, self.consumer_name, stream, topic, partition_id)

    async def close(self) -> None:
        await self._conn.close()
