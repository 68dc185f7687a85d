"""A pytest plugin of scripts/gpu_check.py: prints each failing test's report the moment it
fails (with several workers pytest prints them only at the end, which a run stopped at its
time cap never reaches)."""

from __future__ import annotations

import sys


def pytest_runtest_logreport(report):
    if report.failed:
        text = report.longreprtext
        sys.stderr.write(f"\n==== {report.nodeid} failed ({report.when}):\n{text[-6000:]}\n")
        sys.stderr.flush()
