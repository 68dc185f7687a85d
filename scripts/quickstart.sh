#!/usr/bin/env bash
# The whole job on a built-in default: synthetic Criteo-format logs -> Beam
# preprocessing -> hybrid training -> evaluation -> summary. Sets up .venv/ first
# (PYTHON=python3.12: .venv-3.12/, see _venv.sh).
# Extra arguments go to `hybridrec quickstart` (see --help), e.g. --rows 50000.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec hybridrec quickstart "$@"
