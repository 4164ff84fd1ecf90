#!/usr/bin/env bash
# Runs the test suite (CTest) against ./build.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# The test binaries link OpenBLAS directly; pick its AVX-512/AVX2 kernels as `shardtrain` does.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512bw /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell; fi
fi
ctest --test-dir build --output-on-failure -j 2 --timeout 900
