"""A TCP proxy on a free loopback port, in the test's event loop, that can
cut the link: the test kernel has no netem, so an outage between gateway and
server is simulated here.

`cut()` closes every connection through the proxy and stops listening, so a
new connection is refused (what a dead route or a restarting firewall looks
like to the gateway); `restore()` listens again on the same port and
forwards from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from .ports import free_port


@dataclass
class TcpProxy:
    target_host: str
    target_port: int
    port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"
    accepted: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, self.host, self.port, reuse_address=True)
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
            transport = w.transport
            transport.abort()
        for t in list(self._tasks):
            t.cancel()
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def restore(self) -> None:
        """Listen (on the same port) and forward again."""
        if self._server is None:
            await self.start()

    async def stop(self) -> None:
        await self.cut()
