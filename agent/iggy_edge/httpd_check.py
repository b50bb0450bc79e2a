"""Doctor's agent check: whether a running agent answers on its health
endpoint (httpd.py), and whether it calls itself healthy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from .checks import Check
from .config import Settings
from .httpd import local_url


def check_agent(settings: Settings, timeout: float = 2.0) -> Check:
    if not settings.metrics.enabled:
        return Check("agent", "skip", "metrics endpoint disabled (metrics.enabled = false)")
    url = local_url(settings.metrics.listen) + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout):  # noqa: S310 - http URL
            pass
        return Check("agent", "ok", f"running and healthy ({url})")
    except urllib.error.HTTPError as e:
        doc = json.loads(e.read() or b"{}")
        return Check(
            "agent",
            "warn",
            f"running but unhealthy: ingest {doc.get('ingest')}, store {doc.get('store')}, "
            f"uplink {doc.get('uplink')}",
            "see journalctl -u iggy-edge and iggy-edge status",
        )
    except (OSError, ValueError):
        return Check("agent", "skip", f"not running (nothing at {url})")
