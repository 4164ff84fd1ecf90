#!/usr/bin/env bash
# Assembles .device/, a CUDA build that can be copied to a GPU machine without a build toolchain,
# from a CUDA build directory. Usage, in the repository root:
#     bash bench/pack_device.sh [BUILD_DIR (default build)] [DEST (default .device)]
# then copy the checkout with DEST to the GPU machine; bench/device_env.sh, sourced there first,
# makes it runnable.
#
# What goes in (ldd decides; this machine is Debian 12, the GPU machine's image Ubuntu 24.04):
#   DEST/shardtrain, DEST/test_cuda_backend, test_cuda_model, test_hf_parity, test_nccl_comm, test_zero_equivalence
#       (those that exist; stripped of symbols unless STRIP=0: the CUDA fat binaries stay), and the
#       benchmark programs of EXTRA_BINS (default bench_host_limits) found in BUILD
#   DEST/lib/         shared libraries the GPU image lacks: OpenBLAS (OpenMP build), libgfortran,
#                     libquadmath, fmt, PCRE2, ... (first on LD_LIBRARY_PATH there)
#   DEST/libfallback/ libraries the image has its own, newer or same, copy of (GCC's runtime,
#                     OpenMPI and its dependencies, zlib, udev, small CUDA runtime libraries): used
#                     there only for a name that is missing (device_env.sh links each missing one
#                     into DEST/libmissing), so that Python and PyTorch keep the system's versions
#   not carried:      glibc, the driver (libcuda, libnvidia-*), and CUDA libraries over
#                     FALLBACK_MAX bytes (cuBLAS/cuBLASLt, NCCL, cuDNN: hundreds of MiB); the GPU
#                     image has CUDA 13 and PyTorch's nvidia-* wheels, where device_env.sh looks for
#                     them if the loader does not find them
#   DEST/MANIFEST     what was packed, from which commit, and what is expected on the GPU machine
# LIMIT_MIB bounds what is copied (working tree + DEST, default 64 MiB). If DEST would push the
# total past it (LIMIT_MIB, default 64, minus the working tree, minus 1 MiB), everything is packed
# into DEST/bundle.tar.xz instead, which device_env.sh unpacks there (OpenBLAS alone is ~36 MiB).
# FASHION_MNIST=1 adds Debian's Fashion-MNIST files (see below).
# COMPRESS=always|never|auto (default auto) overrides that choice. TESTS="test_a test_b" picks the
# test programs (default: test_cuda_backend test_cuda_model test_hf_parity test_nccl_comm test_zero_equivalence;
# test_nccl_comm needs two GPUs, so TESTS="test_cuda_backend test_hf_parity test_zero_equivalence"
# is enough for one-GPU calls when the archive is too large). EXTRA_BINS="a b" names other programs
# of BUILD to carry (default: bench_host_limits; left out with a note where not built).
set -euo pipefail
BUILD=${1:-build}
DEST=${2:-.device}
STRIP=${STRIP:-1}
COMPRESS=${COMPRESS:-auto}
LIMIT_MIB=${LIMIT_MIB:-64}
FALLBACK_MAX=${FALLBACK_MAX:-8388608}  # CUDA libraries up to 8 MiB travel as fallbacks
REPO=$(git rev-parse --show-toplevel 2>/dev/null || pwd)

[ -x "$BUILD/shardtrain" ] || { echo "pack_device: no $BUILD/shardtrain (build it first)" >&2; exit 1; }
rm -rf "$DEST"
mkdir -p "$DEST/lib" "$DEST/libfallback"

bins=("$BUILD/shardtrain")
for t in ${TESTS:-test_cuda_backend test_cuda_model test_hf_parity test_nccl_comm test_zero_equivalence}; do
  if [ -x "$BUILD/tests/$t" ]; then bins+=("$BUILD/tests/$t")
  else echo "pack_device: note: $BUILD/tests/$t not built, left out" >&2; fi
done
for x in ${EXTRA_BINS-bench_host_limits}; do
  if [ -x "$BUILD/$x" ]; then bins+=("$BUILD/$x")
  else echo "pack_device: note: $BUILD/$x not built, left out" >&2; fi
done
for b in "${bins[@]}"; do
  cp "$b" "$DEST/"
  if [ "$STRIP" = 1 ]; then strip --strip-unneeded "$DEST/$(basename "$b")"; fi
done
if ! ldd "$BUILD/shardtrain" | grep -q -E "libcudart|libnccl"; then
  echo "pack_device: warning: $BUILD/shardtrain links no CUDA runtime: a CPU-only build?" >&2
fi

# every resolved library of every binary: "name path" (ldd lists the whole closure)
libs=$(for b in "${bins[@]}"; do ldd "$b"; done | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u)
missing=$(for b in "${bins[@]}"; do ldd "$b"; done | awk '/not found/ {print $1}' | sort -u)
if [ -n "$missing" ]; then
  echo "pack_device: error: not found on this machine either: $missing" >&2; exit 1
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
    # GCC's runtime, OpenMPI and what it needs, zlib, udev: the image has its own
    libstdc++.so.*|libgcc_s.so.*|libgomp.so.*|libatomic.so.*|libmpi*.so.*|libopen-rte.so.*|libopen-pal.so.*|libhwloc.so.*|libevent*|libudev.so.*|libz.so.*|libpmix.so.*|libucp.so.*|libucs.so.*|libuct.so.*|libucm.so.*|libfabric.so.*|libibverbs.so.*|librdmacm.so.*|libnl-*|libpsm*|libltdl.so.*|libsystemd.so.*|libcap.so.*|libgcrypt.so.*|liblzma.so.*|libzstd.so.*|liblz4.so.*|libgpg-error.so.*)
      cp -L "$path" "$DEST/libfallback/$name"; continue ;;
    *)
      cp -L "$path" "$DEST/lib/$name" ;;
  esac
done <<< "$libs"

{
  echo "# .device packed by bench/pack_device.sh $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
  echo "build: $(readlink -f "$BUILD"), commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "binaries:"; for b in "${bins[@]}"; do echo "  $(basename "$b") $(stat -c %s "$DEST/$(basename "$b")")"; done
  echo "lib (first on LD_LIBRARY_PATH there):"; for f in "$DEST"/lib/*; do [ -e "$f" ] && echo "  $(basename "$f") $(stat -c %s "$f")"; done
  echo "libfallback (only for names the GPU machine lacks):"; for f in "$DEST"/libfallback/*; do [ -e "$f" ] && echo "  $(basename "$f") $(stat -c %s "$f")"; done
  echo "expected on the GPU machine (not carried):"; for e in "${expected[@]}"; do echo "  $e"; done
  echo "system (not carried): ${skipped[*]}"
} > "$DEST/MANIFEST"

size=$(du -sb "$DEST" | cut -f1)
tree=$(git -C "$REPO" ls-files -z -co --exclude-standard 2>/dev/null | (cd "$REPO" && du -cb --files0-from=- 2>/dev/null) | tail -1 | cut -f1)
tree=${tree:-0}
budget=$(( LIMIT_MIB * 1048576 - tree - 1048576 ))
echo "pack_device: $DEST is $(( size >> 20 )) MiB uncompressed; working tree $(( tree >> 20 )) MiB; budget for $DEST $(( budget >> 20 )) MiB"
if [ "$COMPRESS" = always ] || { [ "$COMPRESS" = auto ] && [ "$size" -gt "$budget" ]; }; then
  tmp=$(mktemp -d)
  tar -C "$DEST" -cf - --exclude=MANIFEST . | xz -T2 -6 > "$tmp/bundle.tar.xz"
  find "$DEST" -mindepth 1 -not -name MANIFEST -delete
  mv "$tmp/bundle.tar.xz" "$DEST/" && rmdir "$tmp"
  echo "bundle.tar.xz (unpacked into .device/ by bench/device_env.sh)" >> "$DEST/MANIFEST"
  size=$(du -sb "$DEST" | cut -f1)
  echo "pack_device: compressed into $DEST/bundle.tar.xz: $(( size >> 20 )) MiB"
fi
# FASHION_MNIST=1: Debian's Fashion-MNIST (~30 MiB of .gz IDX files, already compressed) travels
# beside the bundle in DEST/fashion-mnist; device_env.sh links it into the data directory there.
if [ "${FASHION_MNIST:-0}" = 1 ]; then
  mkdir -p "$DEST/fashion-mnist"
  cp /usr/share/datasets/fashion-mnist/*-ubyte.gz "$DEST/fashion-mnist/"
  echo "fashion-mnist/ (from /usr/share/datasets/fashion-mnist)" >> "$DEST/MANIFEST"
  size=$(du -sb "$DEST" | cut -f1)
fi
cat "$DEST/MANIFEST"
if [ "$size" -gt "$budget" ]; then
  echo "pack_device: error: $DEST ($(( size >> 20 )) MiB) does not fit the device call's $LIMIT_MIB MiB with the working tree;" \
       "pack fewer test programs (TESTS=...)" >&2
  exit 1
fi
