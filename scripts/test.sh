#!/usr/bin/env bash
# Runs the test suite in .venv/ (created and installed on first use; PYTHON=python3.12
# uses .venv-3.12/, see _venv.sh).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/pipeline -k hash`;
# HYBRIDREC_TEST_WORKERS=1 runs them in this process, one after the other.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
echo "[test] $(python --version), jax $(python -c 'from importlib.metadata import version; print(version("jax"))') in ${VIRTUAL_ENV#"$PWD/"}/" >&2
ruff check .           # every package, the scripts and the tests
ruff format --check .  # and their layout (the docs' code blocks keep theirs)
# test files spread over worker processes (pytest-xdist; a file's tests stay together):
# many tests wait on processes they start, so 2 workers on 2 cores take ~0.7x the time
workers="${HYBRIDREC_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
# the 15 slowest tests are listed at the end: where CI's time goes
if (( workers > 1 )); then
  exec python -m pytest -n "$workers" --dist loadfile --durations=15 "$@"
fi
exec python -m pytest --durations=15 "$@"
