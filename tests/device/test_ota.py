"""Over-the-air updates, the board side (issue 21), under the real MicroPython
Unix port with the real umqtt.simple against a real Mosquitto.  The gateway is
``tests/support/ota_sender.py``'s ``OtaSender``: a stand-in for the agent's
updater that follows the contract at the MQTT boundary (the lead adds the
end-to-end tests with the real agent once both sides are merged).  The board
runs env_sensor in the OTA layout (/main.py the loader, the app in a slot);
its power supply (``Supervisor``) boots it again after ``machine.reset()``."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.broker import Broker
from tests.support.micropython import (
    Board,
    Flash,
    MqttLog,
    board_config,
    require_micropython,
    run_script,
    unique_device_id,
    wait_console,
)
from tests.support.ota_sender import (
    OtaSender,
    Supervisor,
    app_files,
    booted_versions,
    install_ota_board,
    manifest,
)
from tests.support.tmpfs import small_tmpfs
from tests.support.wait import wait_until

pytestmark = pytest.mark.micropython

# The functional tests give the board room; the heap with an update in
# progress is its own test (test_ota_heap.py) at the measured figure.
HEAP = "160k"
CONNECTED = "[iggy] connected to"


@pytest.fixture(autouse=True)
def _needs_micropython() -> None:
    require_micropython()


class OtaBoard:
    def __init__(self, broker: Broker, root: Path, **kw: Any) -> None:
        self.broker = broker
        self.dev = unique_device_id("ota")
        self.flash = Flash(root / self.dev)
        state = kw.pop("state", {})
        heap = kw.pop("heap", HEAP)
        cfg = board_config(broker.host, broker.port, self.dev, period_ms=kw.pop("period_ms", 200), **kw)
        install_ota_board(self.flash, "1", cfg, **state)
        self.board = Board(self.flash, heapsize=heap)
        self.sup = Supervisor(self.board)
        self.senders: list[OtaSender] = []
        wait_console(self.board, CONNECTED, what="v1 connected", timeout=60)

    def send(self, version: str, files: dict[str, bytes] | None = None, **kw: Any) -> OtaSender:
        uid = kw.pop("uid", f"u{version}-{self.dev[-8:]}")
        s = OtaSender(self.broker, self.dev, uid, version, files or app_files(version), **kw)
        self.senders.append(s)
        return s

    def console(self) -> str:
        return self.flash.text("_console.log")

    def state(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.flash.text("ota.json"))
        return doc

    def slot_files(self, slot: str) -> dict[str, bytes]:
        d = self.flash.root / "s" / slot
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.sup.stop()


@pytest.fixture
def ota_board(broker: Broker, tmp_path: Path) -> Iterator[Callable[..., OtaBoard]]:
    made: list[OtaBoard] = []

    def make(**kw: Any) -> OtaBoard:
        b = OtaBoard(broker, tmp_path, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _sha(d: dict[str, bytes]) -> dict[str, str]:
    return {k: hashlib.sha256(v).hexdigest() for k, v in d.items()}


def test_an_update_is_applied_confirmed_and_reported_with_the_new_version(
    ota_board: Callable[..., OtaBoard], broker: Broker, tmp_path: Path
) -> None:
    b = ota_board()
    log = MqttLog(broker, f"edge/{b.dev}/#", tmp_path, f"sub-{b.dev}")
    try:
        new = app_files("2", pad=6000)
        s = b.send("2", new)
        result = s.wait_result(120)
        assert result == {"id": s.uid, "st": "done", "v": "2"}
        states = s.states()
        # need ... staged (old version), trial (new version, informational), done
        assert states[0] == "need"
        assert states.index("staged") < states.index("trial") < states.index("done")
        assert "bad" not in states
        assert booted_versions(b.console()) == [("1", "1"), ("2", "2")]
        wait_until(lambda: "rep" not in b.state(), 10, what="the report cleared once PUBACKed")
        st = b.state()
        assert (st["cur"], st["v"], st["id"]) == ("b", "2", s.uid)
        assert not {"trial", "rep", "prev"} & set(st)
        assert _sha(b.slot_files("b")) == _sha(new)  # exactly the manifest's files
        assert not b.flash.path("s/m.json").exists()
        # diag says which version runs (each session)
        log.wait_for(lambda m: any(d.get("app_v") == "2" for d in m.json("/up/diag")), 20, "diag app_v 2")
        # after "done" the receiver is dropped; a probe loads it for an answer
        s.probe()
        wait_until(lambda: "idle" in s.states(), 20, what="idle")
        idle = [r for r in s.replies if r["st"] == "idle"][-1]
        assert idle == {"id": s.uid, "st": "idle", "v": "2", "mpy": 6}  # the .mpy version it loads
        # and the same manifest again (a gateway that restarted) is answered done
        s.send_manifest()
        wait_until(lambda: s.states().count("done") >= 2, 20, what="done again")
    finally:
        log.stop()
    assert "Traceback" not in b.console()


BROKEN = {
    # what breaks -> (trial bounds in ota.json, what the reason says)
    "syntax": ({}, "import: SyntaxError"),
    "import": ({}, "import: RuntimeError('broken at import'"),
    "crash": ({"n": 1}, "not confirmed in 1 boots: RuntimeError('crash in main'"),
    "offline": ({"t": 4}, "not confirmed within 4 s"),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_app_rolls_back_by_itself_and_reports_rolled_back_with_the_reason(
    ota_board: Callable[..., OtaBoard], broken: str
) -> None:
    state, why = BROKEN[broken]
    b = ota_board(state=state)
    s = b.send("2", app_files("2", broken=broken))
    result = s.wait_result(180)
    assert result["st"] == "rolled_back", result
    assert result["v"] == "1"  # the version running again
    assert result["why"].startswith(why), result
    versions = booted_versions(b.console())
    assert versions[0] == ("1", "1")
    assert versions[-1] == ("1", "1")  # the old version is back, connected (it reported)
    wait_until(lambda: "rep" not in b.state(), 10, what="the report cleared once PUBACKed")
    st = b.state()
    assert (st["cur"], st["v"]) == ("a", "1")
    assert "trial" not in st
    assert st["rb"] == [s.uid, result["why"]]
    assert b.flash.text("fatal.txt") == result["why"]  # the reason, kept
    # the gateway asks again: the board says what became of it
    s.send_manifest()
    wait_until(lambda: s.states().count("rolled_back") >= 2, 20, what="rolled_back again")


def test_a_flipped_byte_in_a_chunk_is_detected_and_the_chunk_fetched_again(
    ota_board: Callable[..., OtaBoard],
) -> None:
    b = ota_board()
    new = app_files("2", pad=4000)
    s = b.send("2", new, flip=(0, 1024))
    assert s.wait_result(120)["st"] == "done"
    bad = [r for r in s.replies if r["st"] == "bad"]
    assert bad == [{"id": s.uid, "st": "bad", "f": 0, "o": 1024}]
    assert _sha(b.slot_files("b")) == _sha(new)


def test_a_file_damaged_on_flash_is_found_by_its_sha256_and_fetched_again(
    ota_board: Callable[..., OtaBoard],
) -> None:
    b = ota_board()
    new = app_files("2", pad=4000)
    s = b.send("2", new)
    s.pause_after = 3  # main.py (file 0) is complete after 5 chunks: stop within file 2
    wait_until(s._paused.is_set, 30, what="paused")
    b.sup.stop()
    staged = b.flash.root / "s" / "b" / "main.py"
    data = bytearray(staged.read_bytes())
    data[10] ^= 0xFF  # flash damage (or a torn write) in what was written
    staged.write_bytes(bytes(data))
    # complete the file from the sender's copy, so only its sha256 can tell
    staged.write_bytes(bytes(data) + new["main.py"][len(data) :])
    b.sup = Supervisor(b.board)
    s.resume()
    assert s.wait_result(120)["st"] == "done"
    assert "main.py sha256 does not match: fetching it again" in b.console()
    assert _sha(b.slot_files("b")) == _sha(new)


_REFUSED_STEP = """
import os
from iggy_device import otadl

os.mkdir("s")
os.mkdir("s/b")


class Hw:
    refuse = 1  # the step after the append: the heap refuses it once

    def feed(self):
        if Hw.refuse:
            Hw.refuse = 0
            raise MemoryError("memory allocation failed")


class Dev:
    hw = Hw()

    def log(self, *a):
        print("LOG", *a)


class O:  # the receiver (ota.py) as otadl.py sees it
    dev = Dev()
    n = 0
    m = {"id": "u", "slot": "b", "files": [["app.bin", 8, "0" * 64]]}
    want = None

    def need(self):
        print("NEED", self.want)

    def send(self, doc):
        print("SEND", doc)


o = O()
otadl.resume(o)
chunk = {"f": 0, "o": 0, "h": "SHA"}
try:
    otadl.write(o, chunk, b"abcd")
except MemoryError:
    print("REFUSED")
otadl.write(o, chunk, b"abcd")  # the gateway sends it again
print("SIZE", os.stat("s/b/app.bin")[6])
"""


def test_a_chunk_sent_again_after_a_step_the_heap_refused_is_not_appended_twice(tmp_path: Path) -> None:
    # A MemoryError between a chunk's append and resume() (what the board
    # wants next, from the flash) left `want` at the chunk just written; the
    # gateway's resend of it was appended a second time, the file failed its
    # sha256 and was fetched again from its start (at 64k: 4 times in one
    # run, and a 4th failure fails the update).
    out = run_script(_REFUSED_STEP.replace("SHA", hashlib.sha256(b"abcd").hexdigest()), Flash(tmp_path))
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "SIZE 4" in out.stdout, out.stdout + out.stderr
    assert out.stdout.rstrip().splitlines()[-2] == "NEED [0, 4]", out.stdout


def test_a_reconnect_mid_download_resumes_where_it_stopped(ota_board: Callable[..., OtaBoard]) -> None:
    b = ota_board(wifi_timeout_ms=200)
    new = app_files("2", pad=8000)
    s = b.send("2", new)
    # two chunks into the second file, so the pause is mid-file whatever size
    # main.py (the example, stamped) has: 8 fixed chunks once ended exactly at
    # main.py's end when the example grew
    first = -(-len(new["main.py"]) // 512)  # the board asks for 512-byte chunks (ota.CHUNK)
    assert len(new[list(new)[1]]) > 3 * 512
    s.pause_after = first + 2
    wait_until(s._paused.is_set, 30, what=f"{first + 2} chunks")
    before = [r for r in s.replies if r["st"] == "need"][-1]
    b.flash.path("_hw_wifi_down").write_text("")
    wait_console(b.board, "connection lost", what="the link drop", timeout=60)
    b.flash.path("_hw_wifi_down").unlink()
    wait_console(b.board, CONNECTED, 2, what="reconnected", timeout=60)
    s.resume()
    assert s.wait_result(120)["st"] == "done"
    needs = [(r["f"], r["o"]) for r in s.replies if r["st"] == "need"]
    i = needs.index((before["f"], before["o"]))
    assert before["o"] > 0
    assert (0, 0) not in needs[i:]  # never from the start again
    assert s.bytes_sent <= s.doc["total"] + 2 * 1024  # at most the chunk in flight, again
    assert _sha(b.slot_files("b")) == _sha(new)


def test_a_reboot_mid_download_resumes_from_what_is_on_flash(ota_board: Callable[..., OtaBoard]) -> None:
    b = ota_board()
    new = app_files("2", pad=8000)
    s = b.send("2", new)
    s.pause_after = 9
    wait_until(s._paused.is_set, 30, what="9 chunks")
    before = [r for r in s.replies if r["st"] == "need"][-1]
    b.sup.power_cut()
    wait_console(b.board, CONNECTED, 2, what="booted again", timeout=60)
    # the board greets the new session with what it needs: where it stopped
    wait_until(lambda: len([r for r in s.replies if r["st"] == "need"]) > 9, 20, what="a need")
    after = [r for r in s.replies if r["st"] == "need"][-1]
    assert (after["f"], after["o"]) == (before["f"], before["o"])
    s.resume()
    assert s.wait_result(120)["st"] == "done"
    assert _sha(b.slot_files("b")) == _sha(new)
    assert booted_versions(b.console()) == [("1", "1"), ("1", "1"), ("2", "2")]


def test_an_aborted_download_empties_the_staging_slot(ota_board: Callable[..., OtaBoard]) -> None:
    b = ota_board()
    s = b.send("2", app_files("2", pad=8000))
    s.pause_after = 4
    wait_until(s._paused.is_set, 30, what="4 chunks")
    s.abort()
    r = s.wait_result(20)
    assert r == {"id": s.uid, "st": "failed", "why": "aborted"}
    assert not b.flash.path("s/m.json").exists()
    assert not b.flash.path("s/b").exists()
    assert b.state() == {"cur": "a", "v": "1"}


def _bad(doc: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**doc, **change}


def test_bad_manifests_are_refused_with_the_reason(ota_board: Callable[..., OtaBoard]) -> None:
    b = ota_board()
    files = app_files("2")
    good = manifest("ux", "2", files)
    e0 = good["files"][0]
    cases: list[tuple[dict[str, Any], str]] = [
        (_bad(good, files=[["../main.py", e0[1], e0[2]]]), "bad manifest: path"),
        (_bad(good, files=[["/main.py", e0[1], e0[2]]]), "bad manifest: path"),
        (_bad(good, files=[["lib/.x", 1, e0[2]], e0], total=e0[1] + 1), "bad manifest: path"),
        (_bad(good, files=[["bme280.py", e0[1], e0[2]]], total=e0[1]), "bad manifest: no main.py"),
        (_bad(good, total=good["total"] + 1), "bad manifest: total"),
        (_bad(good, files=[[e0[0], e0[1], "x" * 64]], total=e0[1]), "bad manifest: sha256"),
        (_bad(good, files=[[f"f{i}.py", 0, e0[2]] for i in range(33)], total=0), "bad manifest: 1..32"),
        (_bad(good, files=[[e0[0], 300000, e0[2]]], total=300000), "bad manifest: size"),
        (
            _bad(good, files=[[e0[0], 200000, e0[2]], ["b.bin", 100000, e0[2]]], total=300000),
            "too big: 300000 > 262144",
        ),
        (_bad(good, mpy=1), "mpy version 1, the board loads"),
        (_bad(good, v=""), "bad manifest: version"),
    ]
    for i, (doc, why) in enumerate(cases):
        uid = f"bad{i}"
        s = b.send("2", files, uid=uid, doc={**doc, "id": uid})
        r = s.wait_result(20)
        assert r["st"] == "failed", (i, r)
        assert r["why"].startswith(why), (i, r)
        assert r["id"] == uid
    s = b.send("2", files, uid="bad-id!", doc={**good, "id": "bad id!"})
    wait_until(lambda: any(r["id"] is None for r in s.replies), 20, what="refused id")
    assert next(r for r in s.replies if r["id"] is None) == {
        "id": None,
        "st": "failed",
        "why": "bad manifest: id",
    }
    assert b.state() == {"cur": "a", "v": "1"}
    assert not b.flash.path("s/b").exists()
    assert booted_versions(b.console()) == [("1", "1")]  # it never stopped
    assert "Traceback" not in b.console()


def test_an_update_larger_than_the_free_flash_is_refused(broker: Broker, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "flash", "2m") as root:
        b = OtaBoard(broker, root)
        try:
            # the flash filled to about 100 kB free: a 95 kB update plus the margin does not fit
            free = shutil.disk_usage(root).free
            (root / "filler.bin").write_bytes(b"\0" * max(0, free - 100 * 1024))
            s = b.send("2", app_files("2", pad=90000))
            r = s.wait_result(20)
            assert r["st"] == "failed", r
            assert r["why"].startswith("no space:"), r
            assert b.state() == {"cur": "a", "v": "1"}
            assert not (b.flash.root / "s" / "b").exists() or not any((b.flash.root / "s" / "b").iterdir())
        finally:
            b.close()
