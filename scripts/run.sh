#!/usr/bin/env bash
# One entry point for a fresh machine: creates the virtual environment (torch 2.11.0 from PyPI, a CUDA 13.0
# build), builds flashcore in place, then runs what was asked:
#   scripts/run.sh bench [bench.py args]   benchmark against SDPA (GPU if present, else the CPU path)
#   scripts/run.sh test  [pytest args]     the test suite (GPU tests skip with a reason when no GPU is present)
#   scripts/run.sh build                   environment and build only
# A second command starts its job within seconds: the dependencies are installed once (a stamp in the
# environment), and the build is incremental (ninja's objects stay in ./build; nothing changed, nothing rebuilt;
# one file changed, one file rebuilt). The environment finds the in-place build through a .pth file, as an
# editable install would.
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
deps=("torch==2.11.0" "setuptools>=64" wheel ninja pytest numpy matplotlib nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
      "transformers==5.24.0")
stamp="$venv/.flashcore-deps"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${deps[*]}" ]; then
  echo "[flashcore] installing dependencies into $venv" >&2
  "$py" -m pip install -q --upgrade pip
  "$py" -m pip install -q "${deps[@]}"
  echo "${deps[*]}" > "$stamp"
fi

start=$(date +%s)
echo "[flashcore] building the extension (incremental; MAX_JOBS=${MAX_JOBS:-$(nproc)})" >&2
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$py" setup.py -q build_ext --inplace >&2
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD" > "$site/flashcore-dev.pth"
echo "[flashcore] build done in $(( $(date +%s) - start )) s" >&2

case "$cmd" in
  test) exec "$py" -m pytest tests "$@" ;;
  bench) exec "$py" benchmarks/bench.py "$@" ;;
  build) ;;
  *) echo "usage: scripts/run.sh {test|bench|build} [args]" >&2; exit 2 ;;
esac
