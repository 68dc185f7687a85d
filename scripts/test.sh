#!/usr/bin/env bash
# Runs the test suite in .venv/ (created and installed on first use).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/pipeline -k hash`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
ruff check .   # every package, the scripts and the tests
exec python -m pytest "$@"
