"""The mpremote steps that put the staged files on a board, in order, and
the runner that takes them one by one.

Everything on the board goes through `mpremote` (a subprocess per step, so a
failure names the step).  The board goes into safe mode first (board.py),
the old library goes, the files are copied and every file's SHA-256 on the
board is compared with the staged copy, then safe mode is left and the board
reset: it runs the example.
"""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from . import board, flash
from .errors import NoBoardError, NotMicroPythonError, ProvisionError, busy
from .sources import LIBRARY_PACKAGE
from .staging import Staged, check_mpy

MPREMOTE_TIMEOUT_S = 120.0


class Progress(Protocol):
    """Where `copy_to_board` announces its steps (typer.echo in the CLI)."""

    def __call__(self, message: str, *, nl: bool = True) -> None: ...


def _quiet(message: str, *, nl: bool = True) -> None:
    pass


@dataclass(frozen=True)
class Step:
    label: str
    args: tuple[str, ...]  # mpremote arguments after `connect PORT`


@dataclass
class Plan:
    port: str
    staging: Path
    files: dict[str, Path] = field(default_factory=dict)  # board path -> staged file
    steps: list[Step] = field(default_factory=list)

    def argv(self, mpremote: str, step: Step) -> list[str]:
        return [mpremote, "connect", self.port, *step.args]


PROBE_LABEL = "check the board runs MicroPython"
SAFE_RESET_LABEL = "reset into safe mode (stops the watchdog)"
RESET = ("reset",)


def build_plan(port: str, files: dict[str, Path], staging: Path, *, install_umqtt: bool = True) -> Plan:
    """The mpremote steps in order.  ``install_umqtt``: False when the
    firmware already has umqtt.simple (stock ESP32 firmware freezes it), so
    provisioning needs no internet on the host."""
    plan = Plan(port=port, staging=staging, files=files)
    plan.steps.append(Step(PROBE_LABEL, ("exec", board.PROBE)))
    plan.steps.append(Step("enter safe mode (/safe)", ("exec", board.SAFE_ON)))
    plan.steps.append(Step(SAFE_RESET_LABEL, RESET))
    plan.steps.append(Step("remove the old library", ("exec", board.remove_old_snippet(files))))
    plan.steps.append(Step("create /lib", ("exec", board.MKDIRS.format(pkg=LIBRARY_PACKAGE))))
    by_dir: dict[str, list[str]] = {}
    for board_path in files:
        d = board_path.rpartition("/")[0]
        by_dir.setdefault(d, []).append(board_path)
    for d in sorted(by_dir):
        srcs = [str(files[p]) for p in sorted(by_dir[d])]
        dest = f":{d}/" if d else ":"
        label = f"copy {len(srcs)} files to /{d}" if d else f"copy {len(srcs)} files to /"
        plan.steps.append(Step(label, ("fs", "cp", *srcs, dest)))
    if install_umqtt:
        plan.steps.append(Step("install umqtt.simple (mip)", ("mip", "install", "umqtt.simple")))
    plan.steps.append(
        Step("verify files on the board (sha256)", ("fs", "sha256sum", *(f":{p}" for p in sorted(files))))
    )
    plan.steps.append(Step("leave safe mode", ("exec", board.SAFE_OFF)))
    plan.steps.append(Step("reset to start the example", RESET))
    return plan


def classify(port: str, output: str) -> ProvisionError:
    """Turn mpremote's output into an error a person can act on."""
    text = output.strip()
    if "failed to access" in text or "could not open port" in text.lower():
        if not Path(port).exists() and not port.upper().startswith("COM"):
            return NoBoardError(f"no board on {port}: the port does not exist (see `iggy-edge device ports`)")
        return busy(port)
    if "no device found" in text:
        return NoBoardError("no board found: plug it in, or pass --port (see `iggy-edge device ports`)")
    if "could not enter raw repl" in text:
        return NotMicroPythonError(
            f"something answers on {port} but not a MicroPython REPL: flash MicroPython first, "
            "or press the board's reset button and retry"
        )
    last = text.splitlines()[-1] if text else "(no output)"
    return ProvisionError(f"mpremote failed: {last}")


def run_mpremote(argv: Sequence[str], port: str, timeout: float = MPREMOTE_TIMEOUT_S) -> str:
    """Run one mpremote command; its output, or a classified ProvisionError."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"mpremote did not finish within {timeout:.0f}s on {port}") from None
    output = r.stdout + r.stderr
    if r.returncode != 0:
        raise classify(port, output)
    return output


def parse_sha256sum(output: str) -> dict[str, str]:
    """`mpremote fs sha256sum :a :b` prints `sha256sum :a` then the digest."""
    out: dict[str, str] = {}
    current: str | None = None
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("sha256sum :"):
            current = line[len("sha256sum :") :]
        elif current is not None and len(line) == 64:
            out[current] = line
            current = None
    return out


def verify(files: dict[str, Path], output: str) -> None:
    on_board = parse_sha256sum(output)
    bad = []
    for board_path, staged in sorted(files.items()):
        want = hashlib.sha256(staged.read_bytes()).hexdigest()
        if on_board.get(board_path) != want:
            bad.append(board_path)
    if bad:
        raise ProvisionError("files differ on the board after copying: " + ", ".join(bad))


def probe_board(mpremote: str, port: str) -> str | None:
    """PROBE's output, or None while the board does not answer."""
    try:
        return run_mpremote([mpremote, "connect", port, "exec", board.PROBE], port, timeout=20)
    except ProvisionError:
        return None  # not back yet (booting, or a native-USB board re-enumerating)


def _fit(plan: Plan, probe: board.Probe, say: Progress) -> Plan:
    """The rest of the plan for the board the probe found (its first step,
    the probe, is the same either way)."""
    if probe.frozen is not None:
        # MicroPython looks in the firmware before /lib: a copy would never
        # be imported; the old one still goes (its flash comes back)
        say(f" {LIBRARY_PACKAGE} {probe.frozen} is frozen into the firmware: not copied ...", nl=False)
        lib = f"lib/{LIBRARY_PACKAGE}/"
        files = {p: f for p, f in plan.files.items() if not p.startswith(lib)}
        plan = build_plan(plan.port, files, plan.staging)
    if probe.umqtt:
        # frozen into the firmware (or installed before): no mip, no internet
        plan.steps = [s for s in plan.steps if s.args[:1] != ("mip",)]
    return plan


def copy_to_board(
    mpremote: str, port: str, staged: Staged, staging: Path, *, echo: Progress | None = None
) -> None:
    """Run the plan for `staged` against the board on `port`, one step at a
    time, each announced through `echo` (nothing shown without one)."""
    say: Progress = echo or _quiet
    files = staged.files
    plan = build_plan(port, files, staging)
    n = len(plan.steps)
    i = 0
    while i < len(plan.steps):
        step = plan.steps[i]
        i += 1
        say(f"[{i}/{n}] {step.label} ...", nl=False)
        t0 = time.monotonic()
        try:
            output = run_mpremote(plan.argv(mpremote, step), port)
            if step.label == PROBE_LABEL:
                probe = board.parse_probe(output)
                if probe is None or probe.impl != "micropython":
                    raise NotMicroPythonError(
                        f"the board on {port} does not report MicroPython: {output.strip()[-200:]}"
                    )
                check_mpy(probe, files)
                plan = _fit(plan, probe, say)
                n = len(plan.steps)
            if step.args[:2] == ("fs", "sha256sum"):
                verify(plan.files, output)
            if step.label == SAFE_RESET_LABEL:
                # only here: after the last reset the example runs, and
                # probing it would interrupt it (mpremote sends Ctrl-C)
                try:
                    flash.wait_for_micropython(lambda: probe_board(mpremote, port), timeout=30)
                except flash.FlashError as e:
                    raise ProvisionError(str(e).replace("after flashing", "after the reset")) from None
        except ProvisionError:
            say(" failed")
            raise
        say(f" done ({time.monotonic() - t0:.1f}s)")
