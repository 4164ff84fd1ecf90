#!/usr/bin/env bash
# Assembles a CUDA build that runs on a GPU machine without a toolchain: the binaries of a CUDA
# build directory and the shared libraries the GPU machine may lack, in one folder (.packed/) that
# travels with the checkout.
#
#   1. pack, on the build machine, in the repository root:
#        cmake --build build && bash bench/pack_build.sh [BUILD_DIR (default build)] [DEST (default .packed)]
#   2. copy the checkout with DEST to the GPU machine (DEST is git-ignored, so copy the folder, not
#      a git clone), e.g.
#        rsync -a --exclude /build --exclude /.git ./ gpu-host:shardtrain/
#   3. run there, in the checkout's root:
#        bash bench/run.sh tests single-gpu      # bench/README.md lists the workloads
#      bench/run.sh sources bench/lib/prelude.sh, which unpacks DEST when it was packed compressed,
#      links the libraries the GPU machine lacks and puts WikiText-2 and the tokenizer beside the
#      binary. To run one of the bench/*.py harnesses by hand: `source bench/lib/prelude.sh` first
#      (it sets ST, the packed binary's path).
#
# What goes in (ldd decides; the build machine here is Debian 12, the GPU machine's image Ubuntu
# 24.04 with CUDA 13 and PyTorch):
#   DEST/shardtrain, DEST/test_* of TESTS (default test_cuda_backend test_cuda_model
#       test_hf_parity test_nccl_comm test_zero_equivalence; those that exist), stripped of
#       symbols unless STRIP=0 (the CUDA fat binaries stay), and the programs of EXTRA_BINS
#       (default bench_host_limits; e.g. "bench_host_limits bench_image_ops libkernel_trace.so")
#       found in BUILD_DIR
#   DEST/lib/         shared libraries the GPU image lacks: OpenBLAS (OpenMP build), libgfortran,
#                     libquadmath, fmt, PCRE2, ... (first on LD_LIBRARY_PATH there)
#   DEST/libfallback/ libraries the image has its own, newer or same, copy of (GCC's runtime,
#                     Open MPI and its dependencies, zlib, udev, small CUDA runtime libraries):
#                     used there only for a name that is missing (prelude.sh links each missing
#                     one into DEST/libmissing), so that Python and PyTorch keep the system's own
#   not carried:      glibc, the driver (libcuda, libnvidia-*), and CUDA libraries over
#                     FALLBACK_MAX bytes (cuBLAS/cuBLASLt, NCCL, cuDNN: hundreds of MiB), which
#                     prelude.sh looks for in CUDA's folders and PyTorch's nvidia-* wheels there
#   DEST/MANIFEST     what was packed, from which commit, and what the GPU machine must have
#   DEST/COMMIT       the commit of the build (the tables name it where the copy has no git)
#   DEST/SOURCE_ROOT  the checkout's path on this machine (the test programs read fixtures there:
#                     prelude.sh links it to the copy)
# FASHION_MNIST=1 adds Debian's Fashion-MNIST files (/usr/share/datasets/fashion-mnist, ~30 MiB,
# for the image workloads and checks) in DEST/fashion-mnist.
# LIMIT_MIB (default 64; 0 = none) caps what is copied, working tree + DEST: when DEST would not
# fit beside the working tree (minus 1 MiB), everything is packed into DEST/bundle.tar.xz instead
# (OpenBLAS alone is ~36 MiB), and when even that does not fit the script fails (pack fewer test
# programs: TESTS="test_cuda_backend"). COMPRESS=always|never|auto (default auto) overrides the
# choice.
set -euo pipefail
BUILD=${1:-build}
DEST=${2:-.packed}
STRIP=${STRIP:-1}
COMPRESS=${COMPRESS:-auto}
LIMIT_MIB=${LIMIT_MIB:-64}
FALLBACK_MAX=${FALLBACK_MAX:-8388608}  # CUDA libraries up to 8 MiB travel as fallbacks
REPO=$(git rev-parse --show-toplevel 2>/dev/null || pwd)

[ -x "$BUILD/shardtrain" ] || { echo "pack_build: no $BUILD/shardtrain (build it first)" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST/lib" "$DEST/libfallback"

bins=("$BUILD/shardtrain")
for t in ${TESTS:-test_cuda_backend test_cuda_model test_hf_parity test_nccl_comm test_zero_equivalence}; do
  if [ -x "$BUILD/tests/$t" ]; then bins+=("$BUILD/tests/$t")
  else echo "pack_build: note: $BUILD/tests/$t not built, left out" >&2; fi
done
for x in ${EXTRA_BINS-bench_host_limits}; do
  if [ -f "$BUILD/$x" ]; then bins+=("$BUILD/$x")
  else echo "pack_build: note: $BUILD/$x not built, left out" >&2; fi
done
for b in "${bins[@]}"; do
  cp "$b" "$DEST/"
  if [ "$STRIP" = 1 ]; then strip --strip-unneeded "$DEST/$(basename "$b")"; fi
done
if ! ldd "$BUILD/shardtrain" | grep -q -E "libcudart|libnccl"; then
  echo "pack_build: warning: $BUILD/shardtrain links no CUDA runtime: a CPU-only build?" >&2
fi

# every resolved library of every binary: "name path" (ldd lists the whole closure)
libs=$(for b in "${bins[@]}"; do ldd "$b"; done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u)
missing=$(for b in "${bins[@]}"; do ldd "$b"; done | awk '/not found/ {print $1}' | sort -u)
if [ -n "$missing" ]; then
  echo "pack_build: error: not found on this machine either: $missing" >&2; exit 1
fi

skipped=() expected=()
while read -r name path; do
  [ -n "$name" ] || continue
  case "$name" in
    # glibc and the loader: the GPU machine's own (newer) ones
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|libresolv.so.*|libutil.so.*|ld-linux*|libmvec.so.*)
      skipped+=("$name"); continue ;;
    # the driver
    libcuda.so.*|libnvidia-*|libnvcuvid*)
      skipped+=("$name"); continue ;;
    # CUDA toolkit libraries: small ones as fallbacks, large ones expected there
    libcudart.so.*|libcublas*|libnccl.so.*|libcudnn*|libnvrtc*|libnvJitLink*|libcufft*|libcurand*|libcusparse*|libcusolver*|libnvToolsExt*|libcupti*)
      if [ "$(stat -Lc %s "$path")" -le "$FALLBACK_MAX" ]; then cp -L "$path" "$DEST/libfallback/$name"
      else expected+=("$name ($(( $(stat -Lc %s "$path") >> 20 )) MiB here at $path)"); fi
      continue ;;
    # GCC's runtime, Open MPI and what it needs, zlib, udev: the image has its own
    libstdc++.so.*|libgcc_s.so.*|libgomp.so.*|libatomic.so.*|libmpi*.so.*|libopen-rte.so.*|libopen-pal.so.*|libhwloc.so.*|libevent*|libudev.so.*|libz.so.*|libpmix.so.*|libucp.so.*|libucs.so.*|libuct.so.*|libucm.so.*|libfabric.so.*|libibverbs.so.*|librdmacm.so.*|libnl-*|libpsm*|libltdl.so.*|libsystemd.so.*|libcap.so.*|libgcrypt.so.*|liblzma.so.*|libzstd.so.*|liblz4.so.*|libgpg-error.so.*)
      cp -L "$path" "$DEST/libfallback/$name"; continue ;;
    *)
      cp -L "$path" "$DEST/lib/$name" ;;
  esac
done <<< "$libs"

commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')
echo "$commit" > "$DEST/COMMIT"
# the checkout the build was configured from (CMake's source directory), else this one
source_root=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)
echo "${source_root:-$REPO}" > "$DEST/SOURCE_ROOT"
{
  echo "# $DEST packed by bench/pack_build.sh $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
  echo "build: $(readlink -f "$BUILD"), commit $commit$dirty, sources at $(cat "$DEST/SOURCE_ROOT")"
  echo "binaries:"; for b in "${bins[@]}"; do echo "  $(basename "$b") $(stat -c %s "$DEST/$(basename "$b")")"; done
  echo "lib (first on LD_LIBRARY_PATH there):"; for f in "$DEST"/lib/*; do [ -e "$f" ] && echo "  $(basename "$f") $(stat -c %s "$f")"; done
  echo "libfallback (only for names the GPU machine lacks):"; for f in "$DEST"/libfallback/*; do [ -e "$f" ] && echo "  $(basename "$f") $(stat -c %s "$f")"; done
  echo "expected on the GPU machine (not carried):"; for e in "${expected[@]}"; do echo "  $e"; done
  echo "system (not carried): ${skipped[*]}"
} > "$DEST/MANIFEST"

size=$(du -sb "$DEST" | cut -f1)
if [ "$LIMIT_MIB" = 0 ]; then
  budget=$(( 1 << 62 ))
  echo "pack_build: $DEST is $(( size >> 20 )) MiB uncompressed; no size cap (LIMIT_MIB=0)"
else
  # (files deleted but not yet committed make du complain: its total still counts the others)
  tree=$(git -C "$REPO" ls-files -z -co --exclude-standard 2>/dev/null | (cd "$REPO" || exit 0; du -cb --files0-from=- 2>/dev/null; true) | tail -1 | cut -f1)
  tree=${tree:-0}
  budget=$(( LIMIT_MIB * 1048576 - tree - 1048576 ))
  echo "pack_build: $DEST is $(( size >> 20 )) MiB uncompressed; working tree $(( tree >> 20 )) MiB; room for $DEST under LIMIT_MIB=$LIMIT_MIB: $(( budget >> 20 )) MiB"
fi
if [ "$COMPRESS" = always ] || { [ "$COMPRESS" = auto ] && [ "$size" -gt "$budget" ]; }; then
  tmp=$(mktemp -d)
  tar -C "$DEST" -cf - --exclude=MANIFEST --exclude=COMMIT --exclude=SOURCE_ROOT . | xz -T0 -6 > "$tmp/bundle.tar.xz"
  find "$DEST" -mindepth 1 -not -name MANIFEST -not -name COMMIT -not -name SOURCE_ROOT -delete
  mv "$tmp/bundle.tar.xz" "$DEST/" && rmdir "$tmp"
  echo "bundle.tar.xz (unpacked into $DEST/ by bench/lib/prelude.sh)" >> "$DEST/MANIFEST"
  size=$(du -sb "$DEST" | cut -f1)
  echo "pack_build: compressed into $DEST/bundle.tar.xz: $(( size >> 20 )) MiB"
fi
# FASHION_MNIST=1: Debian's Fashion-MNIST (.gz IDX files, already compressed) travels beside the
# bundle in DEST/fashion-mnist; prelude.sh links it into the data folder there.
if [ "${FASHION_MNIST:-0}" = 1 ]; then
  mkdir -p "$DEST/fashion-mnist"
  cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$DEST/fashion-mnist/"
  echo "fashion-mnist/ (from /usr/share/datasets/fashion-mnist)" >> "$DEST/MANIFEST"
  size=$(du -sb "$DEST" | cut -f1)
fi
cat "$DEST/MANIFEST"
if [ "$size" -gt "$budget" ]; then
  echo "pack_build: error: $DEST ($(( size >> 20 )) MiB) does not fit LIMIT_MIB=$LIMIT_MIB MiB with the" \
       "working tree; pack fewer test programs (TESTS=...) or raise LIMIT_MIB" >&2
  exit 1
fi
