#!/usr/bin/env bash
# Installs shardtrain's build dependencies (Debian 12 / Ubuntu 22.04+) and builds it in ./build.
# The CUDA backend is built too when nvcc is found (/usr/local/cuda/bin or PATH). librsvg2-bin
# (rsvg-convert) renders the pipeline pictures as PNG; without it only the SVG is written.
# libprotobuf-dev and protobuf-compiler encode the TensorBoard event files (--tensorboard); the
# tensorboard Python package (pip, test tooling only) reads them back in the monitor test, which
# is skipped when it is missing. gnuplot-nox draws the pictures of `shardtrain compare` and
# `shardtrain report` (SHARDTRAIN_GNUPLOT names another gnuplot; without one they are skipped).
# libpng, libturbojpeg and zlib decode image data (PNG, JPEG, gzip'd IDX); dataset-fashion-mnist
# is Fashion-MNIST (--dataset fashion-mnist). slurm-wlm and munge host the one-host SLURM cluster
# on which the tests run examples/slurm's batch scripts (scripts/slurm_single_host.sh).
#
# --build-only: only what the program itself needs to build and run (compiler, CMake, OpenBLAS,
# Open MPI, PCRE2, the header libraries, protobuf, libpng, libturbojpeg, zlib) — no GoogleTest,
# SLURM, munge, gnuplot, Fashion-MNIST, clang or Python packages — and ./build without the tests
# (-DSHARDTRAIN_TESTS=OFF); scripts/test.sh then has nothing to run.
#
# Then the two builds the checks of scripts/test.sh need (skipped with --no-checks):
#   ./build-sanitize  the unit tests under AddressSanitizer and UBSan (g++, CPU only)
#   ./build-fuzz      the fuzz targets of the file readers (clang's libFuzzer, tests/fuzz/)
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKS=1
BUILD_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --no-checks) CHECKS=0 ;;
    --build-only) BUILD_ONLY=1; CHECKS=0 ;;
    *) echo "usage: bash scripts/setup.sh [--no-checks | --build-only]" >&2; exit 2 ;;
  esac
done
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
if [ "$BUILD_ONLY" = 1 ]; then
  $SUDO apt-get install -y -qq --no-install-recommends \
    build-essential cmake ninja-build pkg-config xz-utils \
    libopenblas-dev libopenblas-openmp-dev libpcre2-dev nlohmann-json3-dev libcli11-dev libfmt-dev \
    libopenmpi-dev openmpi-bin libprotobuf-dev protobuf-compiler libpng-dev libturbojpeg0-dev \
    zlib1g-dev >/dev/null
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDTRAIN_TESTS=OFF
  cmake --build build -j "$(nproc)" --target shardtrain
  exit 0
fi
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build pkg-config xz-utils \
  libopenblas-dev libopenblas-openmp-dev libpcre2-dev nlohmann-json3-dev libcli11-dev libfmt-dev \
  libgtest-dev libopenmpi-dev openmpi-bin librsvg2-bin libprotobuf-dev protobuf-compiler \
  gnuplot-nox libpng-dev libturbojpeg0-dev zlib1g-dev dataset-fashion-mnist \
  slurm-wlm munge python3 python3-pip >/dev/null
if [ "$CHECKS" = 1 ]; then
  # clang and its libFuzzer runtime (Debian: libclang-rt-dev; Ubuntu ships it with clang).
  $SUDO apt-get install -y -qq --no-install-recommends clang libclang-rt-dev >/dev/null 2>&1 ||
    $SUDO apt-get install -y -qq --no-install-recommends clang >/dev/null
fi
# Debian 12 marks its Python as externally managed: --break-system-packages lets pip install there.
python3 -m pip install --quiet --break-system-packages tensorboard ||
  echo "warning: pip could not install tensorboard: the TensorBoard reader test will be skipped" >&2
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)"
if [ "$CHECKS" = 1 ]; then
  cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDTRAIN_SANITIZE=ON \
    -DSHARDTRAIN_CUDA=OFF
  cmake --build build-sanitize -j "$(nproc)" --target unit_tests
  cmake -S tests/fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++
  cmake --build build-fuzz -j "$(nproc)"
fi
