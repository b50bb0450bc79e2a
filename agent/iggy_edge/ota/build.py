"""Build an update's artifact from an example or an app directory (the CLI's
side; the agent never imports this module).

The slot gets the app's modules as provisioning copies them (staging.py):
``main.py`` stays source (the board's loader imports ``main`` from the
slot), every other ``.py`` is compiled with mpy-cross unless ``mpy`` is off,
ready-made ``.mpy`` files are taken as they are, and with ``with_library``
the device library goes to ``lib/iggy_device/``.  Every ``.mpy`` must be of
one .mpy version: it travels in the manifest, and the board refuses an
update whose version it cannot load (as `device provision` checks it).
Nothing else is taken: the board's config.json and secrets stay where
provisioning put them.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from ..provision.errors import ProvisionError
from ..provision.layout import default_version, module_name
from ..provision.sources import LIBRARY_PACKAGE, examples, tool
from ..provision.staging import mpy_header
from .artifact import MAX_ARTIFACT_BYTES, Artifact, ArtifactError

ENTRY = "main.py"


def _compile(src: Path, out: Path, board_path: str) -> bytes:
    r = subprocess.run(
        [tool("mpy-cross"), "-s", module_name(board_path), "-o", str(out), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise ArtifactError(f"mpy-cross failed on {src}: {r.stderr.strip()}")
    return out.read_bytes()


def _take(
    src_dir: Path, prefix: str, *, mpy: bool, keep_source: set[str], tmp: Path
) -> list[tuple[str, bytes]]:
    files: list[tuple[str, bytes]] = []
    for src in sorted(src_dir.iterdir()):
        if not src.is_file() or src.suffix not in (".py", ".mpy"):
            continue
        name = src.name
        if src.suffix == ".py" and mpy and name not in keep_source:
            if (src_dir / (src.stem + ".mpy")).exists():
                continue  # the ready-made bytecode wins
            out = tmp / f"{len(files)}-{src.stem}.mpy"
            files.append((prefix + src.stem + ".mpy", _compile(src, out, prefix + name)))
        else:
            files.append((prefix + name, src.read_bytes()))
    return files


def build(
    root: Path,
    *,
    example: str | None = None,
    app_dir: Path | None = None,
    with_library: bool = False,
    mpy: bool = True,
    version: str | None = None,
    max_bytes: int = MAX_ARTIFACT_BYTES,
) -> Artifact:
    """The artifact; ArtifactError (or provision's ProvisionError for a
    missing mpy-cross) with a message that says what to change."""
    if (example is None) == (app_dir is None):
        raise ArtifactError("give exactly one of --example NAME and --app DIR")
    if example is not None:
        known = examples(root)
        if example not in known:
            raise ArtifactError(f"unknown example {example!r}; choose one of: {', '.join(known)}")
        src, name = root / "firmware_examples" / example, example
    else:
        assert app_dir is not None
        src, name = app_dir, app_dir.resolve().name
        if not src.is_dir():
            raise ArtifactError(f"{src} is not a directory")
    if not (src / ENTRY).is_file():
        raise ArtifactError(f"{src} has no {ENTRY}: the board's loader starts the app's main")
    with tempfile.TemporaryDirectory(prefix="iggy-edge-ota-") as tmp:
        files = _take(src, "", mpy=mpy, keep_source={ENTRY}, tmp=Path(tmp))
        if with_library:
            lib = root / "device" / LIBRARY_PACKAGE
            files += _take(lib, f"lib/{LIBRARY_PACKAGE}/", mpy=mpy, keep_source=set(), tmp=Path(tmp))
        versions = set()
        for path, data in files:
            if path.endswith(".mpy"):
                versions.add(_mpy_version(path, data, Path(tmp)))
    if len(versions) > 1:
        raise ArtifactError(f"the .mpy files are of several .mpy versions ({sorted(versions)}): rebuild them")
    art = Artifact(
        version or default_version(name, sorted(files)),
        tuple(files),
        versions.pop() if versions else None,
        (f"example {example}" if example else f"app {src.resolve()}")
        + (" + library" if with_library else ""),
    )
    art.check(max_bytes)
    return art


def _mpy_version(path: str, data: bytes, tmp: Path) -> int:
    f = tmp / "head.mpy"
    f.write_bytes(data[:4])
    try:
        return mpy_header(f)[0]
    except ProvisionError as e:  # not an .mpy file
        raise ArtifactError(f"{path}: {e}") from None
