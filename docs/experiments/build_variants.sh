#!/usr/bin/env bash
# Builds the extension for sm_90a (every head dim) once per variant, each in a scratch clone of this checkout's
# HEAD, and leaves stripped copies in .carry/exp/ for benchmarks/ab_builds.py on the GPU machine:
#   base.so       HEAD as committed
#   all.so        HEAD + every patch of docs/experiments, in the order of ORDER below
#   <patch>.so    HEAD + that patch (and the patch it builds on, see ORDER), for each name given as an argument
# Usage: docs/experiments/build_variants.sh [patch-name ...]      (names without .patch; none: base and all)
# Needs the project's .venv (scripts/run.sh build creates it). ~6 min a variant on 2 cores.
set -euo pipefail
root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
out="$root/.carry/exp"
mkdir -p "$out"
py="$root/.venv/bin/python"

# Application order; a patch that builds on another lists it after a colon.
ORDER=(
  fwd_sm90_hdim128_176_key_tiles
  fwd_sm90_split_keys_small_grids:fwd_sm90_hdim128_176_key_tiles
  bwd_sm90_dk_across_steps
  fwd_sm80_softmax_after_v_wait
  fwd_sm80_ldmatrix_lane_offsets:fwd_sm80_softmax_after_v_wait
  sm90_descriptor_offsets
)

build() {  # name, patches...
  local name=$1; shift
  local dir
  dir=$(mktemp -d /tmp/flashcore_variant_XXXX)
  git clone -q "$root" "$dir"
  for p in "$@"; do git -C "$dir" apply "$root/docs/experiments/$p.patch"; done
  ln -s "$root/.venv" "$dir/.venv"
  echo "[variants] $name: ${*:-(no patch)}" >&2
  (cd "$dir" && FLASHCORE_CUDA=1 FLASHCORE_CUDA_ARCHS=90a MAX_JOBS=${MAX_JOBS:-$(nproc)} "$py" setup.py build_ext \
      --inplace > "$out/$name.build.log" 2>&1) || { echo "[variants] $name: build failed, see $out/$name.build.log" >&2; return 1; }
  strip --strip-debug -o "$out/$name.so" "$dir/flashcore/_C.abi3.so"
  rm -rf "$dir"
  echo "[variants] $out/$name.so" >&2
}

deps_of() {  # the patches a name needs, in order
  local want=$1 entry
  for entry in "${ORDER[@]}"; do
    if [ "${entry%%:*}" = "$want" ]; then
      [ "$entry" != "${entry#*:}" ] && echo "${entry#*:}"
      echo "$want"
      return 0
    fi
  done
  echo "unknown patch: $want" >&2
  return 1
}

if [ $# -eq 0 ]; then
  build base
  all=()
  for entry in "${ORDER[@]}"; do all+=("${entry%%:*}"); done
  build all "${all[@]}"
else
  for name in "$@"; do
    deps=$(deps_of "$name") || exit 2
    mapfile -t patches <<< "$deps"
    build "$name" "${patches[@]}"
  done
fi
