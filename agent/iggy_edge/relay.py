"""A TCP relay on a loopback port that can cut the link and heal it.

The demo puts one between the agent and its Iggy server so a newcomer can
cut the uplink (`--cut-uplink-after`, or the ``c`` key) and watch the
buffer fill and drain; the tests and benches use it as their stand-in for a
dead route (the test kernel has no netem).

`cut()` breaks every relayed connection and stops listening, so a new
connect is refused, as after a dead route or a restarting firewall;
`restore()` listens again on the same port and relays from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass
class TcpRelay:
    target_host: str
    target_port: int
    port: int = 0  # 0: a free port, chosen at the first start and kept
    host: str = "127.0.0.1"
    accepted: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def is_cut(self) -> bool:
        return self._server is None

    async def start(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True)
        if self.port == 0:
            self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        self._tasks.update(pipes)
        await asyncio.gather(*pipes, return_exceptions=True)
        self._tasks.difference_update(pipes)
        self._writers -= {writer, up_writer}
        for w in (writer, up_writer):
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    async def cut(self) -> None:
        """Refuse new connections and break every open one."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            w.transport.abort()
        for t in list(self._tasks):
            t.cancel()
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def restore(self) -> None:
        """Listen (on the same port) and relay again."""
        if self._server is None:
            await self.start()

    async def stop(self) -> None:
        await self.cut()
