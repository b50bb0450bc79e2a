"""Migration from the two-topic scheme: read out what is pending there, once.

Before the one-topic scheme (commands.py, "Addressing") a gateway read
``{commands_topic}.{gateway_id}`` and ``{config_topic}.{gateway_id}`` in
``downlink.stream``, ``iggy.partitions`` partitions each, with its read
offsets in ``downlink_offsets``.  An upgraded gateway must not lose what the
cloud side wrote there and it has not read yet.  So, until the inbox notes
`DRAINED_NOTE`, the return poll first reads every partition of the two old
topics from its stored offset + 1 (the same transaction, trust boundary and
dead letters as for the new topic; each old topic gives its messages' kind)
until every one of them answers with nothing new, notes it, and then never
polls them again.  Only then does it poll the new topic, so a device's older
commands go out before its newer ones.

A missing old topic (a gateway provisioned under the new scheme) has nothing
pending.  One the server refuses to show (the gateway's new, least-privileged
user may not read it) is logged as an error, the migration waits for the
next start (nothing is noted) and the new topic is polled meanwhile:
`iggy-edge cloud provision-gateway` grants the read on the old topics when
they exist, so this happens only with a user made by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from ..config import Settings
from ..uplink.protocol import CommandSource, UplinkRejected
from .commands import KIND_COMMAND, KIND_CONFIG, legacy_topics

log = logging.getLogger(__name__)

DRAINED_NOTE: Final = "legacy_drained"  # inbox note: the old topics were read out


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition the return poll reads.  `kind` is fixed for the old
    topics; None for the return-path topic, whose messages say theirs in the
    ``kind`` header."""

    stream: str
    topic: str
    partition_id: int
    kind: str | None

    @property
    def names(self) -> tuple[str, str]:
        return self.stream, self.topic

    def source(self, offset: int) -> str:
        return f"{self.topic}/{self.partition_id}@{offset}"


async def find_legacy(settings: Settings, source: CommandSource) -> list[Partition] | None:
    """The old topics' partitions (all of them, as the server shows them), or
    None when one of them cannot be looked at (the migration waits)."""
    d = settings.downlink
    found: list[Partition] = []
    commands, config = legacy_topics(settings.gateway_id, d)
    for topic, kind in ((commands, KIND_COMMAND), (config, KIND_CONFIG)):
        try:
            newest = await source.last_offsets(d.stream, topic)
        except UplinkRejected as e:
            log.error(
                "return poll: cannot look at %s/%s of the two-topic scheme (%s): commands or configs still"
                " pending there are NOT delivered; grant this gateway's Iggy user poll_messages and"
                " read_topic on it (iggy-edge cloud provision-gateway does) -- tried again at the next start",
                d.stream,
                topic,
                e,
            )
            return None
        if newest is not None:
            found.extend(Partition(d.stream, topic, p, kind) for p in sorted(newest))
    return found
