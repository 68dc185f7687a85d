#!/usr/bin/env bash
# Installing hybridrec on a host with no package index (an air-gapped GPU cluster): fill a
# wheelhouse on a machine that has one, carry it over with the source tree, install there.
#
#   scripts/wheelhouse.sh download DIR [PRESENT]   # here: wheels of hybridrec's
#       dependencies (and its test extra) for the target's Python (TARGET_PYTHON, default
#       3.12) on x86-64 Linux; PRESENT, a file of the target's `pip list --format=freeze`
#       (or bare names, one a line), leaves out what is installed there already
#   scripts/wheelhouse.sh install DIR              # there, in the source tree: installs
#       every wheel of DIR, builds the C extension with the compiler at hand and installs
#       hybridrec (editable), never from the network
#
# What the target has stays as it is (a GPU image's JAX and its CUDA libraries, its
# numpy): nothing installed is replaced, even where a dependency declares tighter bounds
# than the image meets (`pip check` lists them at the end; Apache Beam 2.77's numpy < 2.5
# and protobuf < 7, say, were found to work with numpy 2.5 and protobuf 7). Leave out of
# PRESENT what must be carried at hybridrec's own bounds (flax, optax and orbax, say,
# where the image's are outside them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

requirements() {  # hybridrec's dependencies ("runtime") or its test extra, dask aside
  "$PYTHON" - "$1" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
test = [r for r in project["optional-dependencies"]["test"] if not r.startswith("hybridrec[")]
print("\n".join(project["dependencies"] if sys.argv[1] == "runtime" else test))
EOF
}

case "${1:-}" in
download)
  dir="${2:?usage: wheelhouse.sh download DIR [PRESENT]}"
  target="${TARGET_PYTHON:-3.12}"
  mkdir -p "$dir"
  mapfile -t wanted < <(requirements runtime; requirements test)
  "$PYTHON" -m pip download --quiet --dest "$dir" --only-binary=:all: \
    --python-version "$target" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 \
    setuptools wheel "${wanted[@]}"
  if [[ -n "${3:-}" ]]; then  # what the target has: not carried
    "$PYTHON" - "$dir" "$3" <<'EOF'
import pathlib, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
present = {norm(re.split(r"[=<>~ @]", line.strip())[0]) for line in open(sys.argv[2]) if line.strip()}
for wheel in pathlib.Path(sys.argv[1]).glob("*.whl"):
    if norm(wheel.name.split("-")[0]) in present:
        wheel.unlink()
EOF
  fi
  echo "wheelhouse $dir: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
  ;;
install)
  dir="${2:?usage: wheelhouse.sh install DIR}"
  shopt -s nullglob
  wheels=("$dir"/*.whl)
  # --no-deps: what the host has stays as it is (its numpy, its protobuf, its JAX), even
  # where a package's declared bounds say otherwise; pip check lists those below
  if ((${#wheels[@]})); then
    "$PYTHON" -m pip install --no-index --no-deps "${wheels[@]}"
  fi
  # --no-build-isolation: the build's setuptools and wheel are the installed ones; the C
  # extension is compiled here, for this Python
  "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -e .
  "$PYTHON" -m pip check || echo "wheelhouse: the bounds above are not met as declared" >&2
  "$PYTHON" -c 'import apache_beam, jax, flax, hybridrec.embedding_store._native as n; print("hybridrec installed, jax", jax.__version__, "on", jax.default_backend() + "; native store kernels", n.__file__)'
  ;;
*)
  sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
