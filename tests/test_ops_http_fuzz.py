"""Fuzz the metrics/health endpoint of a running `iggy-edge run` (issue 18,
"How": requests to the HTTP endpoint are a trust boundary: any local user
can send them).

Hypothesis sends arbitrary requests: methods, paths, headers and bodies of
any bytes, garbage, oversized lines, requests cut short (half-closed) or
left hanging.  Invariants: every complete request gets one well-formed
HTTP/1.0 response, every other connection is answered or closed within the
endpoint's bound (REQUEST_TIMEOUT_S), /health keeps answering, and the
agent's memory and file descriptors stay bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iggy_edge.httpd import MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S

from tests.support.broker import Broker
from tests.support.ports import free_port, wait_port
from tests.support.wait import wait_until

# the module-scoped agent: one per run, not one per xdist worker
pytestmark = pytest.mark.xdist_group("ops_http_fuzz")

BINARY = Path(sys.executable).parent / "iggy-edge"
STATUS_LINE = re.compile(rb"HTTP/1\.0 (\d{3}) [A-Za-z ]+\r\n")
# Time a complete request may take to be answered (the endpoint answers at
# once; the slack is for a loaded 2-core CI machine).
ANSWER_S = 5.0


@dataclass
class Running:
    port: int
    pid: int
    rss_kb: int  # once healthy, before any fuzzing


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("http-fuzz")
    broker = Broker(tmp / "broker").start()
    port = free_port()
    config = tmp / "config.toml"
    config.write_text(
        f'gateway_id = "gw-fuzz"\nstate_dir = "{tmp / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
    )
    log = (tmp / "agent.log").open("wb")
    proc = subprocess.Popen([str(BINARY), "run", "-c", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, timeout=30)
        wait_until(lambda: health(port)[0] == 200, 30, what="a healthy agent")
        yield Running(port, proc.pid, rss_kb(proc.pid))
        assert proc.poll() is None, (tmp / "agent.log").read_text()
        assert "Traceback" not in (tmp / "agent.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        broker.stop()


def health(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except OSError:
        return 0, {}


def rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- what to send ------------------------------------------------------------------------

token = st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"get", b"", b"G\x00T"])
method = st.one_of(token, st.binary(max_size=20))
path = st.one_of(
    st.sampled_from([b"/health", b"/metrics", b"/", b"/health?x=1", b"*", b"", b"/%00", b"//health"]),
    st.binary(max_size=60),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.integers(1000, 20_000).map(lambda n: b"/" + b"a" * n),  # oversized request line
)
version = st.sampled_from([b"HTTP/1.0", b"HTTP/1.1", b"HTTP/2", b"", b"HTTP/1.1 extra", b"\xff"])
header = st.tuples(
    st.one_of(
        st.sampled_from([b"Host", b"Content-Length", b"Transfer-Encoding", b"X"]), st.binary(max_size=20)
    ),
    st.one_of(st.sampled_from([b"-1", b"99999999999999999999", b"chunked", b""]), st.binary(max_size=40)),
)
eol = st.sampled_from([b"\r\n", b"\n", b"\r"])


@st.composite
def request(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:  # garbage, often with a head's end
        return draw(st.binary(max_size=2000)) + draw(st.sampled_from([b"", b"\r\n\r\n"]))
    nl = draw(eol)
    sp = st.sampled_from([b" ", b" ", b" ", b"", b"  ", b"\t"])
    line = draw(method) + draw(sp) + draw(path) + draw(sp) + draw(version)
    headers = b"".join(k + b": " + v + nl for k, v in draw(st.lists(header, max_size=6)))
    big = b"X-Big: " + b"b" * draw(st.sampled_from([0, 0, 9000])) + nl
    return line + nl + headers + big + nl + draw(st.binary(max_size=300))


# how the request is sent: whole, in pieces, cut short then half-closed, or
# cut short and left open (the endpoint must close it within its bound)
mode = st.sampled_from(["whole", "pieces", "cut", "hang"])


def read_all(sock: socket.socket, deadline: float) -> tuple[bytes, bool]:
    """Everything until the server closes; (data, closed in time)."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return data, False
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def check_response(sent: bytes, data: bytes) -> None:
    """One well-formed HTTP/1.0 response: status line, headers, a body of
    Content-Length bytes (none for HEAD)."""
    m = STATUS_LINE.match(data)
    assert m, (sent[:200], data[:200])
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, data[:300]
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"Content-Length"])
    assert fields[b"Connection"] == b"close"
    status = int(m.group(1))
    assert status in (200, 400, 404, 405, 503), status
    if sent.startswith(b"HEAD "):
        assert body == b""
    else:
        assert len(body) == length, (length, len(body))


def complete(sent: bytes) -> bool:
    """A request the endpoint must answer: its head ends well inside the bound."""
    end = sent.find(b"\r\n\r\n")
    return end >= 0 and end + 4 <= MAX_REQUEST_BYTES - 100


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=request(), how=mode, cut=st.floats(0, 1))
def test_any_request_gets_a_response_or_a_close_within_the_bound(
    agent: Running, hanging: list[tuple[socket.socket, float]], req: bytes, how: str, cut: float
) -> None:
    sock = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
    keep = False
    try:
        if how == "hang":
            prefix = req[: int(len(req) * cut)]
            if complete(prefix):
                prefix = prefix[: prefix.find(b"\r\n\r\n")]
            opened = time.monotonic()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # oversized: closed early
                sock.sendall(prefix)
            hanging.append((sock, opened))  # checked together, at the end of the module
            keep = True
            return
        if how == "cut":
            req = req[: int(len(req) * cut)]
        try:
            if how == "pieces":
                step = max(1, len(req) // 7)
                for i in range(0, len(req), step):
                    sock.sendall(req[i : i + step])
            else:
                sock.sendall(req)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN
            # closed while we were still sending: an oversized head, or the
            # rest of a body after the response (the endpoint reads no body,
            # and the kernel resets a connection that receives more)
            return
        data, closed = read_all(sock, time.monotonic() + ANSWER_S)
        assert closed, f"not closed within {ANSWER_S}s: {req[:200]!r}"
        if complete(req):
            check_response(req, data)
        elif data:
            check_response(req, data)  # answered anyway: still well-formed
    finally:
        if not keep:
            sock.close()


@pytest.fixture(scope="module")
def hanging() -> Iterator[list[tuple[socket.socket, float]]]:
    """Requests left hanging: each must be closed by the endpoint within
    REQUEST_TIMEOUT_S of when it was opened (or evicted sooner at the cap)."""
    socks: list[tuple[socket.socket, float]] = []
    yield socks
    try:
        for sock, opened in socks:
            data, closed = read_all(sock, opened + REQUEST_TIMEOUT_S + ANSWER_S)
            assert closed, "a hanging request was not closed within the bound"
            assert data == b"" or STATUS_LINE.match(data)
    finally:
        for sock, _ in socks:
            sock.close()


def test_the_endpoint_still_serves_and_stays_bounded_after_the_fuzz(agent: Running) -> None:
    """Runs after the fuzz test (file order): /health answers, and memory and
    descriptors are those of an agent that forgot every request."""
    baseline = fds(agent.pid)
    # one more burst of the worst: 200 oversized heads and 200 garbage lines
    for i in range(400):
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as s:
            try:
                s.sendall(b"GET /" + b"a" * 20_000 if i % 2 else os.urandom(3000))
                s.shutdown(socket.SHUT_WR)
                read_all(s, time.monotonic() + ANSWER_S)
            except OSError:  # closed early: the endpoint refuses oversized heads
                pass
    status, doc = health(agent.port)
    assert status == 200, doc
    assert doc["gateway"] == "gw-fuzz"
    wait_until(
        lambda: fds(agent.pid) <= baseline + 2, 10, what="the agent's descriptors back to the baseline"
    )
    grown = rss_kb(agent.pid) - agent.rss_kb
    assert grown < 20_000, f"RSS grew by {grown} kB over the fuzz (from {agent.rss_kb} kB)"
