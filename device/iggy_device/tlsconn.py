# TLS to the gateway's broker, verified against the gateway CA certificate
# (DER, copied to the board by `iggy-edge device provision --tls`).
#
# umqtt.simple has had two TLS interfaces:
# - 1.4 and later (what `mip install umqtt.simple` gives a board):
#   ``MQTTClient(..., ssl=ctx)`` then ``ctx.wrap_socket(sock, server_hostname=server)``;
# - 1.3 (the PyPI release): ``ssl=True, ssl_params={...}`` then
#   ``ussl.wrap_socket(sock, **ssl_params)``, and MicroPython >= 1.22 has
#   no ``ussl`` any more.
# ``Tls`` works with both: it is the context umqtt >= 1.4 expects, and for
# 1.3 the client gets ``ssl_params`` naming it plus a ``ussl`` entry in
# sys.modules whose wrap_socket hands the socket to it.  Verification is
# always on: CERT_REQUIRED, the gateway CA only, and the broker's name (or
# IP address) checked against its certificate.
import sys

try:
    import tls as _tls  # MicroPython >= 1.23: the built-in (``ssl`` is a frozen wrapper of it)
except ImportError:
    import ssl as _tls  # 1.20 - 1.22: ``ssl`` is the built-in


class Tls:
    def __init__(self, cadata, hostname, timeout_s):
        ctx = _tls.SSLContext(_tls.PROTOCOL_TLS_CLIENT)
        ctx.verify_mode = _tls.CERT_REQUIRED
        ctx.load_verify_locations(cadata)  # positional: the built-in takes no keywords
        self._ctx = ctx
        self.hostname = hostname
        self._timeout = timeout_s
        self.raw = None  # the TCP socket under the last TLS session

    def wrap_socket(self, sock, server_hostname=None, **_):
        wrap = getattr(sock, "wrap", None)
        if wrap is not None:
            # the device's Wire (wire.py): it keeps the TCP socket and its
            # timeouts, and carries on with the TLS stream on top
            return wrap(self._wrap)
        # bound the handshake and every later read/write: the TLS layer
        # reads and writes through this socket
        sock.settimeout(self._timeout)
        return self._wrap(sock)

    def _wrap(self, sock):
        self.raw = sock
        try:
            return self._ctx.wrap_socket(sock, server_hostname=self.hostname)
        except ValueError as e:
            # mbedTLS reports a certificate that does not verify as
            # ValueError: make it a connection failure (backoff, retry)
            # instead of an exception nobody above expects
            sock.close()
            raise OSError("tls: gateway not verified: " + str(e).strip()) from None


class _LegacyUssl:
    # what umqtt.simple 1.3 imports as ``ussl``
    @staticmethod
    def wrap_socket(sock, tls=None, **_):
        return tls.wrap_socket(sock)


def client(MQTTClient, args, tls):
    """An umqtt MQTTClient that connects through ``tls``."""
    c = MQTTClient(*args, ssl=tls)
    if hasattr(c, "ssl_params"):  # umqtt.simple 1.3
        c.ssl_params = {"tls": tls}
        if "ussl" not in sys.modules:
            sys.modules["ussl"] = _LegacyUssl
    return c
