"""Keeping the libraries' own chatter out of the console unless `--verbose` asks for it.

Gloo (JAX's CPU collectives) prints a `[Gloo] Rank N is connected to M peer ranks` line
per process and collective context from C++ straight to file descriptor 1, and XLA /
absl log from C++ to descriptor 2: Python's logging cannot reach either. `hybridrec
launch` drops those lines from what it relays; a multi-process command started any other
way (by hand, by Slurm) filters its own descriptors with `native_output_filtered`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

# Lines of the libraries' own chatter, dropped unless --verbose.
CHATTER_PREFIXES = (b"[Gloo] ",)
# Gloo's threads write at once: a line may hold its prefix midway, or be the tail of one
CHATTER_PARTS = (b"[Gloo] ", b" peer ranks")
# The C++ logging of XLA / absl and of gRPC (Arrow Flight's: e.g. a line per failed TLS
# handshake, which the remote shards' client reports itself in one line), raised to errors
# only (a level the user set still wins).
QUIET_ENVIRONMENT = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "GLOG_minloglevel": "2",
    "GRPC_VERBOSITY": "ERROR",
}
VERBOSE_ENV = "HYBRIDREC_VERBOSE"  # "1": `hybridrec launch --verbose` asks its processes too


def is_chatter(line: bytes | str) -> bool:
    """Whether one output line is library chatter."""
    if isinstance(line, str):
        line = line.encode(errors="replace")
    return line.startswith(CHATTER_PREFIXES) or any(part in line for part in CHATTER_PARTS)


def quiet_native_logging() -> None:
    """Raises XLA's and absl's C++ log threshold to errors, unless the user set one."""
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def _forward(source: int, target: int) -> None:
    """Copies lines from pipe `source` to descriptor `target`, leaving out the chatter."""
    pending = b""
    with os.fdopen(source, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not is_chatter(line))
            if kept:
                os.write(target, kept)
        if pending and not is_chatter(pending):
            os.write(target, pending)


@contextlib.contextmanager
def native_output_filtered(enabled: bool = True) -> Iterator[None]:
    """Within the block, descriptors 1 and 2 pass through a filter that drops chatter lines.

    Everything else is forwarded as it arrives (line by line), and all of it is flushed
    when the block ends, also when it ends with an exception.
    """
    if not enabled:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    routes = []
    for descriptor in (1, 2):
        saved = os.dup(descriptor)
        read_end, write_end = os.pipe()
        os.dup2(write_end, descriptor)
        os.close(write_end)
        forwarder = threading.Thread(
            target=_forward, args=(read_end, saved), name=f"output-filter-{descriptor}", daemon=True
        )
        forwarder.start()
        routes.append((descriptor, saved, forwarder))
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for descriptor, saved, _ in routes:
            os.dup2(saved, descriptor)  # closes the pipe's last write end: the forwarder sees EOF
        for _, saved, forwarder in routes:
            forwarder.join(timeout=5)
            os.close(saved)
