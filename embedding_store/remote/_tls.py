"""TLS for remote shards: Flight's options on both sides, and one line per handshake failure.

Servers listen on `grpc+tls://` with their certificate and key; given a CA they require
every client to present a certificate it signed (mutual TLS). Clients verify the
server's certificate against their CA (or the system's) and the host name they dialled.

gRPC reports most TLS failures as "unavailable", the same as a server that is down,
and a refused client certificate only as "Socket closed". So after such a failure the
client repeats the handshake once with Python's `ssl` and the same files, which says
what went wrong (expired, wrong host name, unknown CA, plaintext on one side, client
certificate refused); a TLS problem then fails at once with that line instead of being
retried until the retry timeout.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow.flight as flight
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles

TLS_SCHEME = "grpc+tls"
_PLAIN_SCHEMES = ("grpc", "grpc+tcp")
_PROBE_TIMEOUT = 5.0
# The HTTP/2 connection preface and an empty SETTINGS frame: a gRPC server that accepted
# the handshake answers with its own SETTINGS; one that refused the client closes.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
# What gRPC says when a TLS handshake failed, or when the peer hung up during one.
_TLS_HINTS = ("ssl handshake", "handshake failed", "peer name", "certificate", "socket closed")
# OpenSSL's verify codes (X509_V_ERR_*) the messages name.
_EXPIRED, _NOT_YET_VALID = 10, 9
_WRONG_NAME = (62, 64)  # host name mismatch, IP address mismatch
_UNKNOWN_ISSUER = (2, 18, 19, 20, 21)
# Handshake errors that mean the other side does not speak TLS at all.
_NOT_TLS = (
    "WRONG_VERSION_NUMBER",
    "RECORD_LAYER_FAILURE",
    "PACKET_LENGTH_TOO_LONG",
    "HTTP_REQUEST",
)


def secure_address(address: str, tls: TLSFiles | None) -> str:
    """The URI to dial: with TLS configured, "grpc://" becomes "grpc+tls://".

    Raises:
        UserError: TLS is configured and the address names another plaintext transport
            (grpc+tcp://, grpc+unix://): the token would cross it unencrypted.
    """
    if tls is None:
        return address
    scheme, sep, rest = address.partition("://")
    if scheme == TLS_SCHEME:
        return address
    if scheme == "grpc":
        return f"{TLS_SCHEME}://{rest}"
    raise UserError(
        f"embedding server address {address} is not a TLS address, but TLS is configured "
        f"({tls.label('ca') if tls.ca else tls.label('cert')}): the client will not send "
        "its token in plaintext; use host:port or grpc+tls://host:port"
    )


def uses_tls(address: str) -> bool:
    return address.startswith(f"{TLS_SCHEME}://")


def client_options(tls: TLSFiles | None) -> dict[str, Any]:
    """Keyword arguments of `flight.FlightClient` for `tls` (none: the system's CAs)."""
    if tls is None:
        return {}
    tls.check_client()
    return {
        "tls_root_certs": tls.read("ca"),
        "cert_chain": tls.read("cert"),
        "private_key": tls.read("key"),
    }


def server_options(tls: TLSFiles | None) -> dict[str, Any]:
    """Keyword arguments of `flight.FlightServerBase` for `tls` (with a CA: mutual TLS)."""
    if tls is None:
        return {}
    tls.check_server()
    options: dict[str, Any] = {
        "tls_certificates": [flight.CertKeyPair(tls.read("cert"), tls.read("key"))]
    }
    if tls.ca:
        options.update(verify_client=True, root_certificates=tls.read("ca"))
    return options


def server_location(location: str, tls: TLSFiles | None) -> str:
    """`location` with the scheme the server listens on: grpc+tls:// with TLS."""
    scheme, _, rest = location.partition("://")
    if tls is not None and scheme in _PLAIN_SCHEMES:
        return f"{TLS_SCHEME}://{rest}"
    if tls is None and scheme == TLS_SCHEME:
        raise UserError(f"{location}: a TLS location needs --tls-cert and --tls-key")
    return location


def diagnose(address: str, tls: TLSFiles | None, error: BaseException) -> str | None:
    """A one-line description of why a call to `address` failed if TLS is the reason.

    None when the failure does not look like TLS (e.g. the server is down: retry).
    """
    text = str(error).lower()
    if not any(hint in text for hint in _TLS_HINTS):
        return None
    parts = urlsplit(address)
    host, port = parts.hostname, parts.port
    if not host or not port:
        return None
    if uses_tls(address):
        problem = _probe_tls(host, port, tls)
        if problem is None and ("ssl handshake" in text or "peer name" in text):
            problem = f"TLS handshake failed ({_last_error(str(error))})"
    else:
        problem = _probe_plaintext(host, port)
    return f"embedding server {address}: {problem}" if problem else None


def _probe_plaintext(host: str, port: int) -> str | None:
    """For a plaintext client: does the server speak TLS?"""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only asks whether the server speaks TLS
    try:
        with socket.create_connection((host, port), _PROBE_TIMEOUT) as sock:
            context.wrap_socket(sock, server_hostname=host).close()
    except (OSError, ValueError):
        return None
    return (
        "it speaks TLS and this client connects in plaintext: give the client the CA of "
        "the servers' certificates (embedding.tls.ca, or --tls-ca) to connect over TLS"
    )


def _probe_tls(host: str, port: int, tls: TLSFiles | None) -> str | None:
    """One handshake as the Flight client makes it; what was refused, or None."""
    try:
        context = ssl.create_default_context(cafile=(tls.ca or None) if tls else None)
        if tls is not None and tls.cert:
            context.load_cert_chain(tls.cert, tls.key, password=b"")
        context.set_alpn_protocols(["h2"])
    except (OSError, ssl.SSLError, UserError):
        return None  # the files were checked when the client was made; nothing to add
    try:
        sock = socket.create_connection((host, port), _PROBE_TIMEOUT)
    except OSError:
        return None  # not there (yet): the caller retries
    with sock:
        try:
            connection = context.wrap_socket(sock, server_hostname=host)
        except ssl.SSLCertVerificationError as error:
            return _verify_problem(error, host, tls)
        except ssl.SSLError as error:
            if error.reason in _NOT_TLS:
                return (
                    "it does not speak TLS (start it with --tls-cert and --tls-key); this "
                    "client is configured for TLS and sends nothing in plaintext"
                )
            return f"TLS handshake failed ({error.reason or error})"
        except OSError:
            return None
        with connection:
            try:
                connection.sendall(_HTTP2_PREFACE)
                answered = bool(connection.recv(1))
            except (OSError, ssl.SSLError):
                answered = False
    if answered:
        return None
    return _client_certificate_problem(tls)


def _verify_problem(error: ssl.SSLCertVerificationError, host: str, tls: TLSFiles | None) -> str:
    code = error.verify_code
    if code == _EXPIRED:
        return "its certificate has expired (renew the server's --tls-cert)"
    if code == _NOT_YET_VALID:
        return "its certificate is not valid yet (check the clocks, or the certificate's dates)"
    if code in _WRONG_NAME:
        return (
            f"its certificate is not valid for the host name {host} (connect by a name the "
            "certificate lists, or reissue it with this one)"
        )
    if code in _UNKNOWN_ISSUER:
        if tls is not None and tls.ca:
            return f"its certificate is not signed by the CA in {tls.label('ca')}"
        hint = tls.name("ca") if tls is not None else "embedding.tls.ca"
        return f"its certificate is not signed by a CA this machine trusts (set {hint})"
    return f"its certificate was refused: {error.verify_message}"


def _client_certificate_problem(tls: TLSFiles | None) -> str:
    """The server completed the handshake and then hung up: it refused the client."""
    if tls is None or not tls.cert:
        names = ("embedding.tls.cert", "embedding.tls.key")
        if tls is not None:
            names = (tls.name("cert"), tls.name("key"))
        return f"it requires a client certificate (mutual TLS): set {names[0]} and {names[1]}"
    expired = _expiry_if_past(tls.cert)
    if expired:
        return f"it refused this client's certificate {tls.label('cert')}: it expired on {expired}"
    return (
        f"it refused this client's certificate {tls.label('cert')}: not signed by the CA "
        "the server trusts (its --tls-ca), or expired"
    )


def _expiry_if_past(path: str) -> str | None:
    """The date a PEM certificate expired on, if it has; None if valid or unknown."""
    try:
        import datetime

        from cryptography import x509  # installed with apache-beam; only refines the message

        certificate = x509.load_pem_x509_certificate(Path(path).read_bytes())
        expiry = certificate.not_valid_after_utc
    except Exception:  # noqa: BLE001 - the generic message stands
        return None
    if expiry < datetime.datetime.now(datetime.UTC):
        return expiry.strftime("%Y-%m-%d %H:%M UTC")
    return None


def _last_error(text: str) -> str:
    """gRPC's innermost reason: the part after the last "last error:"."""
    reason = text.rsplit("last error:", 1)[-1].strip().splitlines()
    return reason[0] if reason else text
