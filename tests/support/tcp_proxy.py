"""The tests' stand-in for a dead route between gateway and server: the
agent's own `TcpRelay` (iggy_edge/relay.py, which the demo uses to cut its
uplink), on a port chosen up front so a test can name it before starting."""

from __future__ import annotations

from dataclasses import dataclass, field

from iggy_edge.relay import TcpRelay

from .ports import free_port


@dataclass
class TcpProxy(TcpRelay):
    port: int = field(default_factory=free_port)
