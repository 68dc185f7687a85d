"""Every test sees an 8-device CPU mesh; set before anything imports JAX."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    flag
    for flag in (os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8")
    if flag
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The commands' compilation cache lives in one fresh directory per test session: nothing
# written to the home directory, and no entry from an earlier session is reused.
os.environ.setdefault(
    "HYBRIDREC_COMPILATION_CACHE", __import__("tempfile").mkdtemp(prefix="hybridrec-jax-cache-")
)

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
CRITEO_SAMPLE = REPO_ROOT.parent / "shared" / "data" / "criteo_kaggle_sample" / "train.tsv.gz"


@pytest.fixture(scope="session")
def criteo_sample() -> Path:
    """The real Criteo sample next to the repo; tests using it skip when it is absent."""
    if not CRITEO_SAMPLE.exists():
        pytest.skip(f"real Criteo sample not present at {CRITEO_SAMPLE}")
    return CRITEO_SAMPLE


def hybridrec(
    *args: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Runs the real `hybridrec` command line in a subprocess; fails the test on error."""
    result = subprocess.run(
        [sys.executable, "-m", "hybridrec", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(
            f"hybridrec {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
        )
    return result


@pytest.fixture(scope="session")
def cli():
    """The `hybridrec(*args, env=None, timeout=300)` subprocess runner."""
    return hybridrec
