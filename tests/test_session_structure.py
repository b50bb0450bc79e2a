"""Issue 22's structure points for ingest and deliver: each at most 450
lines, and one MQTT session loop (mqttconn.keep_session) that both use
instead of a reconnect loop of their own."""

from __future__ import annotations

from pathlib import Path

import iggy_edge
import pytest

pytestmark = pytest.mark.unit

PKG = Path(iggy_edge.__file__).parent
SESSION_USERS = ("ingest.py", "downlink/deliver.py")


@pytest.mark.parametrize("module", SESSION_USERS)
def test_module_is_at_most_450_lines(module: str) -> None:
    assert len((PKG / module).read_text().splitlines()) <= 450


@pytest.mark.parametrize("module", SESSION_USERS)
def test_the_session_loop_is_mqttconns(module: str) -> None:
    text = (PKG / module).read_text()
    assert "keep_session(" in text
    assert "backoff_delay" not in text  # no reconnect loop of its own
