"""Durable file updates: what a reader sees is either the old version or the whole new one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_directory(path: str | Path) -> None:
    """Makes a rename or a new entry in directory `path` durable."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replaces `path` with `text`: written to a temporary file, fsynced, renamed into place."""
    path = Path(path)
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def append_line(path: str | Path, line: str) -> None:
    """Appends one line in one write, after dropping a torn last line (a killed writer)."""
    path = Path(path)
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, (line + "\n").encode())
    finally:
        os.close(descriptor)
