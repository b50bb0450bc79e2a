"""The gateway CA's files are written through a fresh temp file: a symlink
or file planted where the old code put its fixed `*.tmp` name is never
followed, truncated or moved into place (issue 18, item 9)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from iggy_edge.gateway_ca import CaPaths, init

pytestmark = pytest.mark.unit


def test_a_symlink_planted_at_the_temp_name_is_not_followed(tmp_path: Path) -> None:
    paths = CaPaths(
        ca_dir=tmp_path / "ca", server_cert=tmp_path / "certs/s.crt", server_key=tmp_path / "certs/s.key"
    )
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    planted = [
        paths.ca_key.with_name("ca.key.tmp"),
        paths.ca_cert.with_name("ca.crt.tmp"),
        paths.server_key.with_name("s.key.tmp"),
    ]
    for link in planted:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(victim)

    result = init(paths, "gw-1", ["192.0.2.10"])

    assert result.created_ca
    assert victim.read_text() == "precious\n"  # not truncated, no key written through the link
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    for f, mode in ((paths.ca_key, 0o600), (paths.ca_cert, 0o644), (paths.server_key, 0o600)):
        st = f.lstat()
        assert stat.S_ISREG(st.st_mode), f"{f} is not a regular file"
        assert stat.S_IMODE(st.st_mode) == mode, f
    assert b"PRIVATE KEY" in paths.ca_key.read_bytes()
    for link in planted:  # left alone
        assert link.is_symlink()
    # no temp files left behind
    assert not [p for p in tmp_path.rglob(".*.tmp")]
