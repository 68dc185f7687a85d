"""`hybridrec serve`: an export behind the Open Inference Protocol (KServe v2 REST)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridrec.cli._flags import add_tls_flags, read_token_file
from hybridrec.common.errors import UserError
from hybridrec.common.tls import TLSFiles
from hybridrec.serving import MANIFEST_FILE, versions
from hybridrec.serving.server import ServeOptions, serve


def main(argv: list[str]) -> int:
    """`hybridrec serve`."""
    parser = argparse.ArgumentParser(
        prog="hybridrec serve",
        description="Serve an export over HTTP (KServe v2 / Open Inference Protocol): raw "
        "rows or hashed ids in, click probabilities out.",
    )
    parser.add_argument("export", help="export directory (its newest version) or one version")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (0: any free port)")
    parser.add_argument("--token-file", help="file holding the bearer token clients must send")
    add_tls_flags(
        parser,
        cert_help="certificate chain (PEM): serve HTTPS only",
        ca_help="CA certificate (PEM): clients must present a certificate it signed (mutual TLS)",
    )
    parser.add_argument("--max-batch", type=int, default=256, help="rows per forward pass")
    parser.add_argument(
        "--max-delay-ms", type=float, default=2.0, help="how long a batch waits for more requests"
    )
    parser.add_argument("--max-rows", type=int, default=4096, help="rows per request (more: 413)")
    parser.add_argument(
        "--max-body-mb", type=float, default=16.0, help="request body limit in MiB (more: 413)"
    )
    parser.add_argument(
        "--watch", action="store_true", help="load newer versions of the export as they appear"
    )
    parser.add_argument(
        "--keep-histories",
        type=int,
        default=0,
        metavar="N",
        help="sequence runs: keep each user's last N events (POST .../events), so that a "
        "request may name only the user (0: none kept)",
    )
    parser.add_argument(
        "--max-users",
        type=int,
        default=100_000,
        help="with --keep-histories: users kept, the least recently used evicted",
    )
    parser.add_argument(
        "--history-cache-mb",
        type=float,
        default=1024.0,
        help="with --keep-histories: memory for the towers' caches of kept histories (a "
        "request then computes only a user's new events)",
    )
    parser.add_argument(
        "--skip-checksums",
        action="store_true",
        help="check file sizes but not sha256 at load (exports larger than RAM load faster)",
    )
    args = parser.parse_args(argv)
    _check_export(Path(args.export))
    options = ServeOptions(
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        max_rows=args.max_rows,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        token=read_token_file(args.token_file) if args.token_file else None,
        watch=args.watch,
        checksums=not args.skip_checksums,
        tls=TLSFiles.from_flags(args),
        keep_histories=args.keep_histories,
        max_users=args.max_users,
        history_cache_mb=args.history_cache_mb,
    )
    serve(args.export, host=args.host, port=args.port, options=options)
    return 0


def _port(text: str) -> int:
    """--port's value: a TCP port number, 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise UserError(f"--port {text!r} is not a number (0-65535; 0: any free port)") from None
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is outside 0-65535 (0: any free port)")
    return port


def _check_export(path: Path) -> None:
    """A one-line UserError for a run or dataset directory given in place of an export,
    with the command that exports it into a directory of its own."""
    if not path.is_dir() or (path / MANIFEST_FILE).exists() or versions(path):
        return  # an export, or nothing: serving says which
    from hybridrec.cli.export import not_an_export  # imports the training code: only here
    from hybridrec.training.run_log import run_name

    if (other := not_an_export(path)) is None:
        return
    kind, description = other
    if kind == "run":
        out = Path("exports") / run_name(path)
        raise UserError(
            f"{path} is {description}, not an export; export it first with `hybridrec export "
            f"--run {path} --out {out}`, then `hybridrec serve {out}`"
        )
    raise UserError(
        f"{path} is {description}, not an export; serve the export of a run trained on it "
        "(`hybridrec export --run RUN_DIR --out exports/RUN_NAME`)"
    )
