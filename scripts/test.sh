#!/usr/bin/env bash
# Runs the test suite (CTest) against ./build, then — when scripts/setup.sh built them — the unit
# tests under AddressSanitizer and UBSan (./build-sanitize, label "unit" but not "integration":
# the long end-to-end runs of tests/test_properties.cmake, whose checks are about results, run
# in the main pass only) and the fuzz targets (./build-fuzz: each replays its corpus and
# regressions, then fuzzes for SHARDTRAIN_FUZZ_SECONDS, default 20). Any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# Two tests at a time share the cores: OpenMP threads that wait spinning (the default) take the
# CPU from the other test's processes. Beside a training run's spinning threads, the 4 MPI ranks
# of zero_equivalence_np4 took 210 s instead of 8 (39 s with these threads passive); a run alone
# is as fast either way.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# The test binaries link OpenBLAS directly; pick its AVX-512/AVX2 kernels as `shardtrain` does.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  if grep -qw avx512bw /proc/cpuinfo; then export OPENBLAS_CORETYPE=SkylakeX
  elif grep -qw avx2 /proc/cpuinfo; then export OPENBLAS_CORETYPE=Haswell; fi
fi
ctest --test-dir build --output-on-failure -j 2 --timeout 900
if [ -d build-sanitize ]; then
  # Leaks are not checked: MPI, OpenBLAS and OpenMP keep memory until exit by design.
  # allocator_may_return_null: a request beyond memory throws std::bad_alloc, as without ASan.
  ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:detect_stack_use_after_return=0" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    ctest --test-dir build-sanitize --output-on-failure -j 2 --timeout 1800 -L unit -LE integration
else
  echo "test.sh: no ./build-sanitize (scripts/setup.sh --no-checks): the sanitizer tests are skipped"
fi
if [ -d build-fuzz ]; then
  if [ -n "${SHARDTRAIN_FUZZ_SECONDS:-}" ]; then
    cmake -S tests/fuzz -B build-fuzz -DSHARDTRAIN_FUZZ_SECONDS="$SHARDTRAIN_FUZZ_SECONDS" >/dev/null
  fi
  ctest --test-dir build-fuzz --output-on-failure -j 2
else
  echo "test.sh: no ./build-fuzz (scripts/setup.sh --no-checks): the fuzz targets are skipped"
fi
