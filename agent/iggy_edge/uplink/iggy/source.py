"""`CommandSource` over a real Iggy server: the return path's reads.

On poll, a message's ``timestamp()`` is the server's append time (what
`PolledMessage` carries).  Offsets are mirrored by offsets.py.
"""

from __future__ import annotations

from apache_iggy import Consumer, PollingStrategy, ReceiveMessage

from ...config import IggySettings
from ..protocol import PolledMessage, UplinkRejected
from .connection import ClientFactory, Connection
from .errors import is_not_found
from .offsets import get_consumer_offset, store_consumer_offset
from .topics import Topics


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
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self.consumer_name = consumer_name
        self._conn = Connection(settings, "command source", client_factory)
        self._topics = Topics(self._conn)

    async def start(self) -> None:
        await self._conn.client()

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        client = await self._conn.client()
        await self._topics.partitions(stream, topic)
        try:
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
        except UplinkRejected as e:
            if is_not_found(e):
                self._topics.forget(stream, topic)
            raise
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

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        await store_consumer_offset(self._conn, self.consumer_name, stream, topic, partition_id, offset)

    async def read_mirrored_offset(self, stream: str, topic: str, partition_id: int) -> int | None:
        """The offset the server holds for our consumer on this partition (what
        the cloud side sees), or None when none was stored."""
        return await get_consumer_offset(self._conn, self.consumer_name, stream, topic, partition_id)

    async def close(self) -> None:
        await self._conn.close()
