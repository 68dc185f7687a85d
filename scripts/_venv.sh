# Sourced by the entry scripts: creates a virtual environment at the repo root on first use
# and (re)installs the project whenever pyproject.toml, setup.py or the native kernels change.
# Idempotent.
#
# PYTHON picks the interpreter (default python3). Each Python version gets its own
# environment: the default interpreter's is .venv/, another version's is .venv-X.Y/
# (PYTHON=python3.12 -> .venv-3.12/). An environment found with a different Python
# version than the one asked for is rebuilt, never reused.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON_BIN="${PYTHON:-python3}"

_hybridrec_py_version() {  # prints X.Y of the interpreter $1, or fails
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

if ! want_version="$(_hybridrec_py_version "$PYTHON_BIN")"; then
  # A pyenv shim (python3.12) fails unless that version is selected; take the newest
  # installed pyenv version that provides the command.
  found=""
  pyenv_bin="$(command -v pyenv || echo "${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv")"
  if [ -x "$pyenv_bin" ]; then
    pyenv_version="$("$pyenv_bin" whence "$PYTHON_BIN" 2>/dev/null | sort -V | tail -n 1 || true)"
    if [ -n "$pyenv_version" ]; then
      found="$(PYENV_VERSION="$pyenv_version" "$pyenv_bin" which "$PYTHON_BIN" 2>/dev/null || true)"
    fi
  fi
  if [ -z "$found" ] || ! want_version="$(_hybridrec_py_version "$found")"; then
    echo "[setup] PYTHON=$PYTHON_BIN is not a working Python interpreter" >&2
    exit 1
  fi
  PYTHON_BIN="$found"
fi

default_version="$(_hybridrec_py_version python3 || true)"
if [ -z "${PYTHON:-}" ] || [ "$want_version" = "$default_version" ]; then
  VENV="$REPO_ROOT/.venv"
else
  VENV="$REPO_ROOT/.venv-$want_version"
fi

if [ -x "$VENV/bin/python" ]; then
  have_version="$(_hybridrec_py_version "$VENV/bin/python" || echo broken)"
  if [ "$have_version" != "$want_version" ]; then
    echo "[setup] $VENV holds Python $have_version, not $want_version: recreating it" >&2
    "$PYTHON_BIN" -m venv --clear "$VENV"
  fi
else
  echo "[setup] creating virtual environment in $VENV (Python $want_version)" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
stamp="$VENV/.hybridrec-installed"
want="$( { echo "$want_version"; cat "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/setup.py" \
  "$REPO_ROOT"/embedding_store/*.c; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing hybridrec and its dependencies into $VENV (first run takes a minute or two)" >&2
  # pip's own output (resolver notes, warnings about configured locations) goes to a
  # log that is shown only when the install fails.
  log="$VENV/hybridrec-install.log"
  if ! { "$VENV/bin/python" -m pip install --quiet --upgrade pip \
         && "$VENV/bin/python" -m pip install --quiet -e "$REPO_ROOT[test]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "[setup] installing hybridrec failed (pip's output above, also in $log)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
  echo "[setup] done" >&2
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$REPO_ROOT"
