"""A throwaway CA and certificates for trying TLS on one machine (tests and benchmarks too).

Writes into OUT: ca.pem (+ ca.key), server.pem/server.key for the given host names and
IP addresses, client.pem/client.key (a client certificate for mutual TLS). Keys are
ECDSA P-256, written unencrypted with mode 600. Not for a real cluster: there the CA
key stays offline (or in your secret manager / cert-manager) and every server gets its
own certificate; see docs/scale.md ("Security model").

    python scripts/make_certs.py /tmp/hybridrec-tls --hosts localhost,127.0.0.1
    hybridrec serve-embeddings ... --tls-cert /tmp/hybridrec-tls/server.pem \\
        --tls-key /tmp/hybridrec-tls/server.key --tls-ca /tmp/hybridrec-tls/ca.pem

Needs the `cryptography` package (installed with apache-beam, and in the test extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its private key."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def write(self, out: str | Path, stem: str) -> tuple[Path, Path]:
        """Writes OUT/stem.pem and OUT/stem.key (mode 600); returns their paths."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = out / f"{stem}.pem", out / f"{stem}.key"
        cert_path.write_bytes(self.certificate.public_bytes(serialization.Encoding.PEM))
        key_bytes = self.key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(key_bytes)
        return cert_path, key_path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder, days: int, expired: bool):
    now = datetime.datetime.now(datetime.UTC)
    if expired:  # valid for a day, ten days ago
        return builder.not_valid_before(now - datetime.timedelta(days=11)).not_valid_after(
            now - datetime.timedelta(days=10)
        )
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=days)
    )


def new_ca(common_name: str = "hybridrec test CA", days: int = 30) -> Issued:
    """A self-signed CA certificate that may sign server and client certificates."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    return Issued(_validity(builder, days, False).sign(key, hashes.SHA256()), key)


def issue(
    ca: Issued,
    common_name: str,
    *,
    hosts: Sequence[str] = (),
    client: bool = False,
    days: int = 30,
    expired: bool = False,
) -> Issued:
    """A certificate signed by `ca`: for servers at `hosts` (DNS names or IP addresses),
    or with `client` for a client (mutual TLS); `expired` one ended ten days ago."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
    )
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return Issued(_validity(builder, days, expired).sign(ca.key, hashes.SHA256()), key)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the PEM files into")
    parser.add_argument(
        "--hosts",
        default="localhost,127.0.0.1",
        help="comma-separated DNS names and IP addresses the server certificate is valid for",
    )
    parser.add_argument("--days", type=int, default=30, help="validity of every certificate")
    args = parser.parse_args(argv)
    hosts = [host.strip() for host in args.hosts.split(",") if host.strip()]
    ca = new_ca(days=args.days)
    ca.write(args.out, "ca")
    issue(ca, hosts[0] if hosts else "server", hosts=hosts, days=args.days).write(
        args.out, "server"
    )
    issue(ca, "hybridrec client", client=True, days=args.days).write(args.out, "client")
    print(
        f"wrote {args.out}/ca.pem, server.pem/.key (for {', '.join(hosts)}), client.pem/.key",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
