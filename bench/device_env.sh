#!/usr/bin/env bash
# Sourced at the start of a command on the GPU machine (the `device` tool): makes the carried
# build (.device/: binaries + the shared libraries Ubuntu's image lacks) runnable there.
# The binaries have /work/main paths compiled in (data, fixtures), so the checkout is linked there.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /work
[ "$(readlink -f /work/main)" = "$PWD" ] || ln -sfn "$PWD" /work/main
mkdir -p /work/main/build/data
if [ ! -f /work/main/build/data/wikitext-2/wiki.train.tokens ]; then
  tar -C /work/main/build/data -xJf data/wikitext-2/wikitext-2-v1.tar.xz
  cp -r data/gpt2-tokenizer /work/main/build/data/
fi
# The carried binary looks for its data next to itself (.device/data); point it at the copy above.
export SHARDTRAIN_DATA_DIR=/work/main/build/data
# Fashion-MNIST (Debian's dataset-fashion-mnist here) travels in .device/fashion-mnist when packed
# with FASHION_MNIST=1 (bench/pack_device.sh).
if [ -d .device/fashion-mnist ] && [ ! -e /work/main/build/data/fashion-mnist ]; then
  ln -sfn "$PWD/.device/fashion-mnist" /work/main/build/data/fashion-mnist
fi
# bench/pack_device.sh packs .device/ into one archive when it would not fit the call uncompressed
if [ -f .device/bundle.tar.xz ] && [ ! -e .device/shardtrain ]; then
  tar -C .device -xJf .device/bundle.tar.xz
fi
export LD_LIBRARY_PATH="$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
set +e
# Libraries the carried binaries need that the loader does not find here: each one, by name, from
# .device/libfallback (packed from the build machine), CUDA's folders or PyTorch's nvidia-* wheels,
# linked into .device/libmissing (last on the path, so Python keeps the system's versions of the
# others). Repeated, since a fallback library can need another.
st_link_missing() {
  local dir="$PWD/.device/libmissing" site lib cand round
  mkdir -p "$dir"
  site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  case ":$LD_LIBRARY_PATH:" in *":$dir:"*) ;; *) export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dir" ;; esac
  for round in 1 2 3 4; do
    local missing
    missing=$(for b in .device/shardtrain .device/test_* .device/bench_*; do [ -x "$b" ] && ldd "$b" 2>/dev/null; done |
      awk '/not found/ {print $1}' | sort -u)
    [ -n "$missing" ] || return 0
    for lib in $missing; do
      for cand in "$PWD/.device/libfallback/$lib" /usr/local/cuda/lib64/"$lib" /usr/local/cuda/lib/"$lib" \
          /usr/local/cuda/targets/x86_64-linux/lib/"$lib" $(for s in $site; do
            ls "$s"/nvidia/*/lib/"$lib" "$s"/nvidia/cu*/lib/"$lib" "$s"/torch/lib/"$lib" 2>/dev/null; done); do
        if [ -e "$cand" ]; then ln -sfn "$(readlink -f "$cand")" "$dir/$lib"; echo "device_env: $lib from $cand"; break; fi
      done
    done
  done
  for b in .device/shardtrain .device/test_* .device/bench_*; do [ -x "$b" ] && ldd "$b" | grep "not found" | sed "s|^|device_env: $b still lacks |"; done
  return 0
}
[ -d .device ] && st_link_missing
# libcudnn.so.9 loads its engine libraries (libcudnn_cnn.so.9, ...) by name from its own folder.
if [ -e .device/libmissing/libcudnn.so.9 ]; then
  export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$(readlink -f .device/libmissing/libcudnn.so.9)")"
fi
