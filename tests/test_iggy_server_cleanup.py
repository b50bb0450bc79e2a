"""No iggy-server node outlives the process that started it (issue 23).

A child Python process starts a real 3-node `IggyCluster` the way the bench
does (tests/support/iggy_server.py, `stop_on_signals`), prints its nodes'
pids and sleeps; the test then interrupts it -- SIGINT (Ctrl-C), SIGTERM
(``timeout``, a CI runner) or SIGKILL -- either once the cluster is up or
while it is still starting (the nodes launched, `start` waiting for them),
and checks that every node is gone.  Before issue 23 the nodes ran in
sessions of their own with no death signal: they survived SIGTERM and
SIGKILL in both phases, and SIGINT during the start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.iggy_server import iggy_server_binary

pytestmark = [
    pytest.mark.iggy,
    pytest.mark.skipif(iggy_server_binary() is None, reason="iggy-server not on PATH"),
]

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.support.iggy_server import IggyCluster, stop_on_signals
stop_on_signals()
cluster = IggyCluster(Path({workdir!r})).start()
try:
    print(json.dumps([n.proc.pid for n in cluster.nodes]), flush=True)
    time.sleep(600)
finally:
    cluster.stop()
"""


def _servers_of(parent: int) -> list[int]:
    """The iggy-server processes whose parent is `parent`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.find("(") + 1 : text.rfind(")")]
        if name == "iggy-server" and int(text.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("phase", ["running", "starting"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_no_node_survives_its_parent(tmp_path: Path, sig: signal.Signals, phase: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=str(ROOT), workdir=str(tmp_path / "cluster"))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "agent"), str(ROOT)])},
    )
    pids: list[int] = []
    try:
        assert child.stdout is not None
        if phase == "starting":
            deadline = time.monotonic() + 30
            while len(pids) < 3 and time.monotonic() < deadline:
                pids = _servers_of(child.pid)
                time.sleep(0.05)
        else:
            line = child.stdout.readline()
            assert line, f"the child printed no pids (exit {child.wait(30)})"
            pids = json.loads(line)
        assert len(pids) == 3
        assert child.poll() is None, "the cluster started too fast to interrupt it while starting"
        assert all(_alive(p) for p in pids)
        child.send_signal(sig)
        child.wait(60)
        deadline = time.monotonic() + 45  # a clean shutdown of three nodes, on a loaded machine
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        survivors = [p for p in pids if _alive(p)]
        assert not survivors, f"iggy-server nodes {survivors} outlived their parent after {sig.name}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
        for p in pids:  # never leave one behind, whatever the result
            if _alive(p):
                os.kill(p, signal.SIGKILL)
