#!/usr/bin/env bash
# One entry point for a fresh machine: creates the virtual environment (torch 2.11.0 from PyPI, a CUDA 13.0
# build), builds flashcore in place, then runs what was asked:
#   scripts/run.sh bench [bench.py args]   benchmark against SDPA (GPU if present, else the CPU path)
#   scripts/run.sh test  [pytest args]     the test suite (GPU tests skip with a reason when no GPU is present)
#   scripts/run.sh build                   environment and build only
# Environment: FLASHCORE_VENV (default .venv), MAX_JOBS (default: all cores), and setup.py's FLASHCORE_* knobs.
set -euo pipefail
cd "$(dirname "$0")/.."

cmd=${1:-test}
shift || true

venv=${FLASHCORE_VENV:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "[flashcore] creating $venv" >&2
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
echo "[flashcore] installing dependencies into $venv" >&2
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==2.11.0" "setuptools>=64" wheel ninja pytest numpy matplotlib \
  nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm

echo "[flashcore] building the extension (MAX_JOBS=${MAX_JOBS:-$(nproc)})" >&2
start=$(date +%s)
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$py" -m pip install -q -e . --no-build-isolation
echo "[flashcore] build done in $(( $(date +%s) - start )) s" >&2

case "$cmd" in
  test) exec "$py" -m pytest tests "$@" ;;
  bench) exec "$py" benchmarks/bench.py "$@" ;;
  build) ;;
  *) echo "usage: scripts/run.sh {test|bench|build} [args]" >&2; exit 2 ;;
esac
