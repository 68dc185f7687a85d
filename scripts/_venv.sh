# Sourced by the entry scripts: creates .venv/ at the repo root on first use and
# (re)installs the project whenever pyproject.toml, setup.py or the native kernels change.
# Idempotent.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
stamp="$VENV/.hybridrec-installed"
want="$(cat "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/setup.py" "$REPO_ROOT"/embedding_store/*.c \
  | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing hybridrec and its dependencies into $VENV (first run takes about a minute)" >&2
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
