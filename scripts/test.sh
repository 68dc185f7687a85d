#!/usr/bin/env bash
# Runs the test suite in .venv/ (created and installed on first use; PYTHON=python3.12
# uses .venv-3.12/, see _venv.sh).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/pipeline -k hash`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
echo "[test] $(python --version), jax $(python -c 'from importlib.metadata import version; print(version("jax"))') in ${VIRTUAL_ENV#"$PWD/"}/" >&2
ruff check .   # every package, the scripts and the tests
exec python -m pytest "$@"
