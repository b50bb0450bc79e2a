"""The gateway's own certificate authority, for TLS between boards and the
local Mosquitto.

Made on first use (`iggy-edge device ca init`): a CA key and self-signed CA
certificate, and a server certificate for the broker signed by it, carrying
every name and address the boards use to reach the gateway (a board verifies
the name it connects to against these).  Provisioning copies the CA
certificate (DER: smaller, and what mbedTLS on a board parses fastest) to each
board.  The CA key stays on the gateway, root only.

Keys are ECDSA P-256: every mbedTLS build MicroPython ships verifies it, the
handshake is cheaper on an ESP32 than RSA-2048, and certificates are small.

Built with the `cryptography` package rather than the openssl command line:
typed objects instead of assembling argument strings and config files for
SANs, errors as exceptions, and no dependence on which openssl version the
gateway has.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .ca_paths import CA_DIR, SERVER_CERT, SERVER_KEY, CaPaths

__all__ = ["CA_DIR", "SERVER_CERT", "SERVER_KEY", "CaError", "CaPaths", "InitResult", "init", "server_names"]

CA_DAYS = 20 * 365
SERVER_DAYS = 10 * 365  # boards cannot be reached to renew often; the CA pins trust


class CaError(Exception):
    """A failure with a message meant for the person at the keyboard."""


def _write(path: Path, data: bytes, mode: int, gid: int | None = None) -> None:
    """Replace `path` atomically with `data`.  The temp file beside it gets
    a fresh random name, created with O_EXCL | O_NOFOLLOW (mkstemp): a file
    or symlink planted at a predictable name (these directories may be
    reachable by others) is never opened, followed or truncated; mode and
    owner are set on the open descriptor before the data goes in."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if gid is not None and os.geteuid() == 0:
                os.fchown(f.fileno(), 0, gid)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "iggy-edge"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _san(names: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(entries)


def _load_ca(paths: CaPaths) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    try:
        key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    except FileNotFoundError as e:
        raise CaError(
            f"the gateway CA is incomplete: {e.filename} is missing "
            f"(move {paths.ca_dir} aside and init again)"
        ) from None
    except PermissionError as e:
        raise CaError(f"cannot read {e.filename}: run it with sudo") from None
    except ValueError as e:
        raise CaError(f"the gateway CA in {paths.ca_dir} is unreadable: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CaError(f"{paths.ca_key} is not an EC key")
    return key, cert


def _new_ca(
    paths: CaPaths, gateway: str, now: dt.datetime
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"iggy-edge gateway CA {gateway}")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    paths.ca_dir.mkdir(parents=True, exist_ok=True)
    paths.ca_dir.chmod(0o755)
    _write(paths.ca_key, key_pem, 0o600)
    _write(paths.ca_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(paths.ca_der, cert.public_bytes(serialization.Encoding.DER), 0o644)
    return key, cert


def issue_server_cert(
    paths: CaPaths,
    names: list[str],
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    key_gid: int | None,
) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(_san(names), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Mosquitto reads its key after dropping to its own user: root:mosquitto 0640.
    _write(paths.server_key, key_pem, 0o640 if key_gid is not None else 0o600, key_gid)
    # the chain: server first, then the CA (boards are given the CA anyway)
    chain = cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
    _write(paths.server_cert, chain, 0o644)
    return cert


@dataclass(frozen=True)
class InitResult:
    created_ca: bool
    issued_server: bool
    names: tuple[str, ...]


def server_names(paths: CaPaths) -> list[str]:
    """Names and addresses in the server certificate's SAN ([] when none)."""
    try:
        cert = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    except (FileNotFoundError, PermissionError, ValueError):
        return []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n) for n in san.get_values_for_type(x509.DNSName)] + [
        str(ip) for ip in san.get_values_for_type(x509.IPAddress)
    ]


def init(
    paths: CaPaths, gateway: str, names: list[str], *, renew_server: bool = False, key_gid: int | None = None
) -> InitResult:
    """Create the CA when absent; issue the server certificate when absent,
    when ``renew_server`` asks, or when ``names`` are not all in it."""
    if not names:
        raise CaError("give at least one --san: the name or address the boards use for the broker")
    now = dt.datetime.now(dt.UTC)
    created = not paths.ca_key.exists()
    if created:
        ca_key, ca_cert = _new_ca(paths, gateway, now)
    else:
        ca_key, ca_cert = _load_ca(paths)
    have = server_names(paths)
    issued = False
    if renew_server or created or not paths.server_key.exists() or not set(names) <= set(have):
        keep = [] if renew_server else [n for n in have if n not in names]
        issue_server_cert(paths, [*names, *keep], ca_key, ca_cert, now, key_gid)
        issued = True
        have = server_names(paths)
    return InitResult(created_ca=created, issued_server=issued, names=tuple(have))
