"""A MicroPython with the device library frozen in: device/manifest.py
(``iggy_device`` and umqtt.simple) built into the 32-bit float32 Unix port
(../shared/tools/README.md's build, 4-byte words and float32 as an ESP32),
as device/README.md's "A firmware with the library frozen in" builds one for
an ESP32.  The library's bytecode is then in the firmware and no heap goes to
it, so the device tests and benches can measure a board flashed that way.

Built from MicroPython's sources, which are in no package registry: a
checkout outside the repo at ``$IGGY_EDGE_MICROPYTHON_SRC`` (default
/usr/local/src/micropython; device/README.md says how to make one), with
Debian's gcc-multilib (.ci/setup installs it when the checkout is there).
Without the checkout the callers skip with that reason, as tests without
an iggy-server do.  The build is MicroPython's own make, incremental, into
a cache outside the repo; its binary is kept per digest of the sources it
froze, so nothing runs a firmware older than the library beside it."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = Path(os.environ.get("IGGY_EDGE_MICROPYTHON_SRC", "/usr/local/src/micropython"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "iggy-edge" / "micropython-frozen"
# ../shared/tools/README.md's flags (the 32-bit float32 build), with the
# library's manifest frozen in instead of nothing
FLAGS = (
    "MICROPY_FORCE_32BIT=1",
    "MICROPY_PY_BTREE=0",
    "MICROPY_PY_FFI=0",
    "CFLAGS_EXTRA=-DMICROPY_FLOAT_IMPL=MICROPY_FLOAT_IMPL_FLOAT",
)


def _digest() -> str:
    h = hashlib.sha256(" ".join(FLAGS).encode())
    git = ["git", "-C", str(SRC), "rev-parse", "HEAD"]
    # not a git checkout: the flags and the library alone
    head = subprocess.run(git, check=False, capture_output=True, text=True)
    h.update(head.stdout.encode())
    device = REPO / "device"
    for f in [device / "manifest.py", *sorted((device / "iggy_device").glob("*.py"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def missing() -> str | None:
    """Why no frozen firmware can be built here, or None."""
    if not (SRC / "ports" / "unix" / "Makefile").is_file():
        return f"no MicroPython source checkout at {SRC} (IGGY_EDGE_MICROPYTHON_SRC; device/README.md)"
    for sub in ("lib/micropython-lib/micropython/umqtt.simple", "lib/mbedtls/library"):
        if not (SRC / sub).is_dir():
            return f"{SRC} lacks its submodule {sub.split('/')[1]} (git submodule update --init)"
    if shutil.which("make") is None or shutil.which("gcc") is None:
        return "no make and gcc to build MicroPython"
    return None


def frozen_firmware() -> str:
    """The path of the firmware for the library as it is in this checkout,
    built first if need be (a build from scratch took 21 s on this 2-core
    machine, a rebuild after a library change seconds).  Call ``missing()`` first."""
    out = CACHE / f"micropython-{_digest()}"
    if out.exists():
        return str(out)
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers and other checkouts share the build
        if out.exists():
            return str(out)
        manifest = CACHE / "manifest.py"
        manifest.write_text(f'include("{REPO / "device" / "manifest.py"}")\n')
        build = CACHE / "build"
        make = ["make", "-C", str(SRC / "ports" / "unix"), "-j2", f"BUILD={build}"]
        r = subprocess.run(
            [*make, f"FROZEN_MANIFEST={manifest}", *FLAGS],
            check=False,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"building the frozen firmware failed:\n{(r.stdout + r.stderr)[-3000:]}")
        tmp = out.with_suffix(".tmp")
        shutil.copy(build / "micropython", tmp)
        tmp.rename(out)
        for old in sorted(CACHE.glob("micropython-*"), key=lambda f: f.stat().st_mtime)[:-8]:
            old.unlink()  # the builds of library versions long gone
    return str(out)


def for_bench(wanted: bool) -> str | None:
    """A bench's ``--frozen``: the firmware (built if need be), None when not
    wanted; the bench exits with the reason when none can be built here."""
    if not wanted:
        return None
    why = missing()
    if why:
        raise SystemExit(f"--frozen: {why}")
    return frozen_firmware()


def label(firmware: str | None) -> dict[str, str]:
    """The benches' ``firmware`` key: which board a figure is for."""
    return {"firmware": "library frozen in" if firmware else "port, library on flash"}
