"""GET_CLUSTER_METADATA (code 12): which nodes a cluster has and which one
leads, as the server tells it.

SDK 0.9.0 (Python) has no call for it, so `doctor` sends it raw.  The reply
(core/binary_protocol responses/system/get_cluster_metadata.rs, server
0.9.0-edge.5) is: name (u32 LE length + UTF-8), node count u32 LE, then per
node name and ip (each u32 LE length + UTF-8), the tcp, quic, http and
websocket ports (u16 LE each), role u8 (0 leader, 1 follower) and status u8
(0 healthy, 1 starting, 2 stopping, 3 unreachable, 4 maintenance, 5
unknown).  A server outside cluster mode answers with itself alone.
Checked against a real 3-node cluster: every node names node 0 the leader
while it lives.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

GET_CLUSTER_METADATA_CODE: Final = 12
ROLES: Final = ("leader", "follower")
STATUSES: Final = ("healthy", "starting", "stopping", "unreachable", "maintenance", "unknown")


@dataclass(frozen=True, slots=True)
class ClusterNode:
    name: str
    ip: str
    tcp_port: int
    role: str
    status: str

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.tcp_port}"


@dataclass(frozen=True, slots=True)
class ClusterMetadata:
    name: str
    nodes: tuple[ClusterNode, ...]

    @property
    def leader(self) -> ClusterNode | None:
        return next((n for n in self.nodes if n.role == "leader"), None)


def _label(names: tuple[str, ...], value: int) -> str:
    return names[value] if value < len(names) else f"code {value}"


def decode_cluster_metadata(payload: bytes) -> ClusterMetadata:
    """Decode a GET_CLUSTER_METADATA reply; ValueError when it is malformed."""
    pos = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(payload):
            raise ValueError(f"cluster metadata reply cut short at byte {pos} of {len(payload)}")
        values = struct.unpack_from(fmt, payload, pos)
        pos += size
        return values

    def text() -> str:
        nonlocal pos
        (n,) = take("<I")
        if pos + n > len(payload):
            raise ValueError(f"cluster metadata reply cut short at byte {pos} of {len(payload)}")
        raw = payload[pos : pos + n]
        pos += n
        return raw.decode(errors="replace")

    name = text()
    (count,) = take("<I")
    nodes = []
    for _ in range(count):
        node_name, ip = text(), text()
        tcp, _quic, _http, _ws, role, status = take("<HHHHBB")
        nodes.append(ClusterNode(node_name, ip, tcp, _label(ROLES, role), _label(STATUSES, status)))
    return ClusterMetadata(name, tuple(nodes))
