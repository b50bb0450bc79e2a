"""A real small tmpfs for disk-full tests (root only; skipped with a reason
otherwise)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (e.g. "4m") at `where`; unmount on exit."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_disk(filler: Path) -> Path:
    """Fill the file system of `filler` with it; what is left is < 64 KiB."""
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True, check=False)
    assert shutil.disk_usage(filler.parent).free < 64 * 1024, "the filler did not fill the file system"
    return filler
