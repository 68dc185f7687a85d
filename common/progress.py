"""Progress lines for long-running commands: rate, ETA and a closing summary."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours:d}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:d}:{secs:02d}"


def _format_count(value: float) -> str:
    for threshold, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


class Progress:
    """Throttled one-line progress reports on stderr.

    Example:
        progress = Progress("generate", total=1_000_000, unit="rows")
        for chunk in chunks:
            progress.update(len(chunk))
        progress.close()

    Args:
        name: label printed at the start of every line.
        total: expected number of units (may be fractional, e.g. MB), or None when unknown
            (no ETA then).
        unit: what is being counted ("rows", "samples", "steps").
        interval: minimum seconds between two lines.
        stream: where to write; stderr by default.
    """

    def __init__(
        self,
        name: str,
        *,
        total: float | None = None,
        unit: str = "rows",
        interval: float = 2.0,
        stream: TextIO | None = None,
    ):
        self.name = name
        self.total = total
        self.unit = unit
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self.count = 0
        self.start = time.perf_counter()
        self._last_print = self.start
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def rate(self) -> float:
        return self.count / max(self.elapsed, 1e-9)

    def update(self, n: float = 1, **fields: float | str) -> None:
        """Adds `n` units; prints a line if `interval` seconds have passed.

        Extra keyword fields (loss=0.45, staleness=3) are shown after the rate.
        """
        self.count += n
        now = time.perf_counter()
        if now - self._last_print >= self.interval:
            self._last_print = now
            self._print(self.line(**fields), final=False)

    def line(self, **fields: float | str) -> str:
        parts = [f"[{self.name}]"]
        if self.total:
            percent = 100.0 * self.count / self.total
            parts.append(
                f"{_format_count(self.count)}/{_format_count(self.total)} {self.unit} ({percent:.0f}%)"
            )
        else:
            parts.append(f"{_format_count(self.count)} {self.unit}")
        parts.append(f"{_format_count(self.rate)} {self.unit}/s")
        for key, value in fields.items():
            parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
        if self.total and self.count:
            remaining = (self.total - self.count) / max(self.rate, 1e-9)
            parts.append(f"ETA {_format_duration(remaining)}")
        parts.append(f"elapsed {_format_duration(self.elapsed)}")
        return "  ".join(parts)

    def note(self, text: str) -> None:
        """Prints one line of its own (an event between progress lines)."""
        self._print(f"[{self.name}] {text}", final=True)

    def _print(self, text: str, *, final: bool) -> None:
        if self._tty and not final:
            self.stream.write("\r" + text + "\x1b[K")
        else:
            self.stream.write(("\r" if self._tty else "") + text + "\n")
        self.stream.flush()

    def close(self, **fields: float | str) -> None:
        """Prints the final line (count, rate, elapsed)."""
        self._print(self.line(**fields), final=True)
