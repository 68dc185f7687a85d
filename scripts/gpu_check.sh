#!/usr/bin/env bash
# The GPU check: one prepared command for a GPU host without a package index.
#
#   scripts/gpu_check.sh --fill-wheels [DIR]   # here, with an index: the wheelhouse of what
#       the GPU image lacks (scripts/gpu_image_packages.txt lists what it has), for Python
#       3.12 on x86-64 Linux, default .wheelhouse-gpu/ (ignored by git, ~45 MiB)
#   scripts/gpu_check.sh --out DIR [--wheels DIR] [--budget SECONDS]
#       # there, in the source tree with the wheelhouse beside it: installs the wheels and
#       # hybridrec (building its C extension) into the image's Python, keeping its JAX, then
#       # runs scripts/gpu_check.py with JAX_PLATFORMS=cuda: the HSTU kernel benchmark, the
#       # JAX-facing tests, bench_gpu, a train -> evaluate -> export -> serve round trip and
#       # what the budget leaves for the time-gap kernel and the sequence loop, each with its
#       # own time cap, the whole within --budget (default 450 s)
#   scripts/gpu_check.sh --rehearse --out DIR  # the same steps at a tiny size on the CPU, in
#       # the repository's .venv/ (tests/test_gpu_check.py runs it)
#   ... -- --steps tests bench_gpu --tests FILE...   # some steps, other tests
#
# DIR receives gpu_check.json (printed last) and the steps' logs: 8 files at most.
set -euo pipefail
cd "$(dirname "$0")/.."
out="" wheels=".wheelhouse-gpu" rehearse=0 budget="" fill=""
while (($#)); do
  case "$1" in
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --wheels) wheels="${2:?--wheels needs a directory}"; shift 2 ;;
    --budget) budget="${2:?--budget needs seconds}"; shift 2 ;;
    --rehearse) rehearse=1; shift ;;
    --fill-wheels) fill="${2:-.wheelhouse-gpu}"; shift $(($# > 1 ? 2 : 1)) ;;
    --) shift; break ;; # the rest goes to scripts/gpu_check.py (--steps, --tests)
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [[ -n "$fill" ]]; then
  rm -rf "$fill"
  TARGET_PYTHON=3.12 bash scripts/wheelhouse.sh download "$fill" scripts/gpu_image_packages.txt
  # what the check never runs there: the linter and the Kubernetes manifests' test extras
  rm -f "$fill"/ruff-* "$fill"/kubernetes_validate-* "$fill"/cloudcoil* "$fill"/pydantic*
  echo "wheelhouse for the GPU check: $fill, $(ls "$fill" | wc -l) wheels, $(du -sh "$fill" | cut -f1)"
  exit 0
fi
[[ -n "$out" ]] || { echo "gpu_check: --out DIR is required (see --help)" >&2; exit 2; }
mkdir -p "$out"
log="$out/gpu_check.log"

if ((rehearse)); then
  source scripts/_venv.sh
  export JAX_PLATFORMS=cpu
  exec python scripts/gpu_check.py --out "$out" --rehearse ${budget:+--budget "$budget"} "$@"
fi

{
  echo "== gpu_check: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
} | tee "$log"
echo "== what the image has: $("${PYTHON:-python3}" -m pip list --format=freeze 2>/dev/null | tr '\n' ' ')" >>"$log"
if [[ ! -d "$wheels" ]]; then
  echo "gpu_check: wheelhouse $wheels not found: fill it where an index is reachable with" \
    "scripts/gpu_check.sh --fill-wheels $wheels, and carry it" | tee -a "$log" >&2
  exit 2
fi
PYTHON="${PYTHON:-python3}"
start=$SECONDS
if ! PYTHON="$PYTHON" bash scripts/wheelhouse.sh install "$wheels" >>"$log" 2>&1; then
  tail -n 20 "$log" >&2
  echo "gpu_check: installing from $wheels failed (the whole output: $log)" >&2
  exit 2
fi
echo "== installed in $((SECONDS - start)) s: $(tail -n 1 "$log")" | tee -a "$log"
export JAX_PLATFORMS=cuda
exec "$PYTHON" scripts/gpu_check.py --out "$out" ${budget:+--budget "$budget"} "$@"
