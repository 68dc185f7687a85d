# Sourced by the entry scripts: creates .venv/ at the repo root on first use and
# (re)installs the project whenever pyproject.toml changes. Idempotent.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PYTHON_BIN="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
stamp="$VENV/.hybridrec-installed"
want="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing hybridrec and its dependencies into $VENV (first run takes about a minute)" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -e "$REPO_ROOT[test]" >&2
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$REPO_ROOT"
