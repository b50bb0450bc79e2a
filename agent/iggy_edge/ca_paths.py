"""Where the gateway CA and the broker's TLS files live (see gateway_ca.py).

Apart from gateway_ca so the CLI can name these paths without importing
the `cryptography` package: every `iggy-edge` command, `run` included,
imports the CLI, and cryptography would add about 9 MB to the agent's RSS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CA_DIR = Path("/etc/iggy-edge/ca")
SERVER_CERT = Path("/etc/mosquitto/certs/iggy-edge-server.crt")
SERVER_KEY = Path("/etc/mosquitto/certs/iggy-edge-server.key")


@dataclass(frozen=True)
class CaPaths:
    ca_dir: Path = CA_DIR
    server_cert: Path = SERVER_CERT
    server_key: Path = SERVER_KEY

    @property
    def ca_key(self) -> Path:
        return self.ca_dir / "ca.key"

    @property
    def ca_cert(self) -> Path:
        return self.ca_dir / "ca.crt"

    @property
    def ca_der(self) -> Path:
        return self.ca_dir / "ca.der"
