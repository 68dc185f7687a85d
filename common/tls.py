"""TLS material of one side of a connection: certificate, private key, CA; checked before use.

The embedding shard servers (Arrow Flight over `grpc+tls://`), their clients (the trainer,
`serve-embeddings --check`) and `hybridrec serve` (HTTPS) all name PEM files the same way:

    cert  this side's certificate chain (a server's, or a client's for mutual TLS)
    key   the private key of `cert` (unencrypted PEM)
    ca    the CA certificate(s) that sign the other side's certificate: a client verifies
          the server against it; a server given one requires client certificates it signed

`TLSFiles` keeps the paths with the flag or config key each came from, so every problem
with a file is one line naming the file and where it was given, e.g.
`--tls-key /etc/hybridrec/server.key: no such file`. Checks use the standard library's
`ssl` only; nothing here talks to the network.

Example:
    files = TLSFiles.from_config(config.embedding.tls, "embedding.tls")  # None: TLS off
    files.check_client()
    ca_pem = files.read("ca")
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from pathlib import Path
from typing import Any, Literal

from hybridrec.common.errors import UserError

Part = Literal["cert", "key", "ca"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TLSConfig:
    """TLS of a client's connections (paths of PEM files; all empty: plaintext)."""

    ca: str = ""  # CA certificate that signs the servers' certificates ("" = the system's CAs)
    cert: str = ""  # this client's certificate, for servers that require one (mutual TLS)
    key: str = ""  # the private key of `cert`


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """Paths of one side's PEM files ("" = not given) and the names they were given under.

    Attributes:
        cert / key / ca: file paths.
        names: part -> the flag or config key the path came from (for error messages).
    """

    cert: str = ""
    key: str = ""
    ca: str = ""
    names: tuple[tuple[str, str], ...] = (
        ("cert", "--tls-cert"),
        ("key", "--tls-key"),
        ("ca", "--tls-ca"),
    )

    @classmethod
    def from_flags(cls, args: Any) -> TLSFiles | None:
        """From parsed `--tls-cert/--tls-key/--tls-ca` flags; None when none is given."""
        files = cls(cert=args.tls_cert or "", key=args.tls_key or "", ca=args.tls_ca or "")
        return files if files.enabled else None

    @classmethod
    def from_config(cls, config: TLSConfig, prefix: str) -> TLSFiles | None:
        """From a `TLSConfig` found at config key `prefix`; None when every path is empty."""
        names = tuple((part, f"{prefix}.{part}") for part in ("cert", "key", "ca"))
        files = cls(cert=config.cert, key=config.key, ca=config.ca, names=names)
        return files if files.enabled else None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def name(self, part: Part) -> str:
        """The flag or config key of `part`, e.g. "--tls-ca" or "embedding.tls.ca"."""
        return dict(self.names)[part]

    def label(self, part: Part) -> str:
        """`part`'s name and path, as error messages quote it: "--tls-ca /etc/ca.pem"."""
        return f"{self.name(part)} {getattr(self, part)}"

    def read(self, part: Part) -> bytes | None:
        """The bytes of `part`'s file, None when it is not given."""
        path = getattr(self, part)
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            raise UserError(f"{self.label(part)}: no such file") from None
        except IsADirectoryError:
            raise UserError(f"{self.label(part)}: is a directory, not a PEM file") from None
        except OSError as error:
            raise UserError(f"{self.label(part)}: cannot read it ({error.strerror})") from None

    def check_server(self) -> None:
        """A server needs a certificate and its key; a CA (client certificates) is optional."""
        if not (self.cert and self.key):
            missing = "cert" if not self.cert else "key"
            given = [self.name(part) for part in ("cert", "key", "ca") if getattr(self, part)]
            raise UserError(
                f"{' and '.join(given)} given without {self.name(missing)}: a TLS server "
                f"needs its certificate ({self.name('cert')}) and private key ({self.name('key')})"
            )
        self._check_files()

    def check_client(self) -> None:
        """A client certificate comes with its key; the CA is optional (system CAs)."""
        if bool(self.cert) != bool(self.key):
            given, missing = ("cert", "key") if self.cert else ("key", "cert")
            raise UserError(
                f"{self.label(given)} given without {self.name(missing)}: a client "
                "certificate needs its private key and the other way round"
            )
        self._check_files()

    def _check_files(self) -> None:
        """Each given file exists, is readable and holds what it should (PEM)."""
        for part in ("cert", "key", "ca"):
            self.read(part)  # existence and permissions first: the clearest messages
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if self.ca:
            _load_certificates(context, self.ca, self.label("ca"))
        if not self.cert:
            return
        _load_certificates(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), self.cert, self.label("cert"))
        try:
            # a key that needs a passphrase fails here instead of prompting for one
            context.load_cert_chain(self.cert, self.key, password=b"")
        except ssl.SSLError as error:
            if error.reason == "KEY_VALUES_MISMATCH":
                raise UserError(
                    f"{self.label('key')}: not the private key of {self.label('cert')}"
                ) from None
            raise UserError(f"{self.label('key')}: not an unencrypted PEM private key") from None

    def warn_readable_key(self) -> str | None:
        """A warning line when the private key file can be read by other users, else None."""
        if not self.key:
            return None
        try:
            mode = os.stat(self.key).st_mode
        except OSError:
            return None
        if mode & 0o077:
            return (
                f"{self.label('key')} is readable by other users (mode {mode & 0o777:o}); "
                "chmod 600 it"
            )
        return None


def _load_certificates(context: ssl.SSLContext, path: str, label: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError:
        raise UserError(f"{label}: no PEM certificate in it") from None
