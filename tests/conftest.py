"""Every test sees an 8-device CPU mesh; set before anything imports JAX."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    flag
    for flag in (os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8")
    if flag
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
