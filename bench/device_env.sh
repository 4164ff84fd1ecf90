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
export LD_LIBRARY_PATH="$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
set +e
