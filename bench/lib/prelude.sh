# shellcheck shell=bash disable=SC2034
# Sourced on the GPU machine, in the repository root, by bench/run.sh (or by hand, before running
# a bench/*.py harness yourself): makes the packed build runnable here and sets up what every
# workload uses. The build is the folder bench/pack_build.sh assembled (PACKED, default .packed).
#
# What it does to this machine (not under DRY_RUN=1):
#   - unpacks PACKED/bundle.tar.xz when the build was packed compressed;
#   - links the checkout's path on the build machine (PACKED/SOURCE_ROOT; test programs read their
#     fixtures under it) to this checkout, when that path is free;
#   - unpacks WikiText-2 and copies the GPT-2 tokenizer into PACKED/data (the binary's own data
#     folder) and links Fashion-MNIST there when it was packed (FASHION_MNIST=1);
#   - puts PACKED/lib first on LD_LIBRARY_PATH and links each library the binaries still miss from
#     PACKED/libfallback, CUDA's folders or PyTorch's nvidia-* wheels into PACKED/libmissing (last
#     on the path, so that Python keeps this machine's own copies of the others).
# What it sets:
#   ST, SHARDTRAIN  the packed shardtrain (SHARDTRAIN: what tests/gpu/run_equivalence.sh runs)
#   OUT             results folder (default ./bench-out): summary.txt, JSON, logs.tgz
#   SUM             $OUT/summary.txt (/dev/null under DRY_RUN=1)
#   LOGS            long logs and run folders (default: in a temporary folder, LOGS_TMP; run.sh
#                   tars LOGS into $OUT/logs.tgz at the end)
#   GPUS            GPUs to use: as given, else as many as CUDA_VISIBLE_DEVICES names, else every
#                   GPU `nvidia-smi -L` lists (1 under DRY_RUN=1 when none is found)
#   COMMIT          the build's commit (PACKED/COMMIT, written by pack_build.sh)
#   COMMIT_ARGS     (--commit COMMIT) where this checkout has no git history, else empty
#   MPIRUN          mpirun with --bind-to none (and --allow-run-as-root as root)
#   NCORES          the cores this process may use
# and exports, unless already set, NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1 (NVLink multicast off, as in every published table), OMP_NUM_THREADS=8,
# PYTHONUNBUFFERED=1,
# and the helpers say, q, step, step_out, grab, cap and run_gtest (below). It prints the GPUs, the
# CPU, the host memory and the build's MANIFEST head into the summary.

PACKED=${PACKED:-.packed}
DRY_RUN=${DRY_RUN:-0}
PACKED_ABS=$PWD/$PACKED
[ "${PACKED#/}" = "$PACKED" ] && [ "$DRY_RUN" != 1 ] || PACKED_ABS=$PACKED  # dry run: as given
if [ "$DRY_RUN" = 1 ]; then OUT=${OUT:-\$OUT}; else OUT=${OUT:-$PWD/bench-out}; fi
T0=${T0:-$(date +%s)}
export PYTHONUNBUFFERED=1 GTEST_COLOR=no
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
# OpenMP threads of every shardtrain process (the CPU workloads and the host optimizer of the
# offload strategies take the machine's cores unless OMP_NUM_THREADS is set: USER_OMP)
USER_OMP=${USER_OMP-${OMP_NUM_THREADS:-}}
NCORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the cores this process may use
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

dry() { [ "$DRY_RUN" = 1 ]; }

# q ARG...: the arguments as one line that a shell reads back as the same arguments (a dry run
# leaves $OUT and $LOGS in them unquoted, for the shell to expand)
q() {
  local a s=""
  for a in "$@"; do
    if [[ -n $a && $a =~ ^[A-Za-z0-9_./:=,+@%^-]+$ ]] || { dry && [[ $a =~ ^([A-Za-z_][A-Za-z0-9_]*=)?\$[A-Z]+[A-Za-z0-9_./:=,+@%^*-]*$ ]]; }; then s+=" $a"
    else s+=" '${a//\'/\'\\\'\'}'"; fi
  done
  printf '%s\n' "${s# }"
}

# ---- make the packed build runnable --------------------------------------------------------------
st_prepare_build() {
  if [ ! -d "$PACKED_ABS" ]; then
    echo "prelude: no $PACKED here: pack a CUDA build with bench/pack_build.sh and copy it along" >&2
    return 1
  fi
  if [ -f "$PACKED_ABS/bundle.tar.xz" ] && [ ! -e "$PACKED_ABS/shardtrain" ]; then
    tar -C "$PACKED_ABS" -xJf "$PACKED_ABS/bundle.tar.xz"
  fi
  # The test programs read fixtures under the build machine's checkout (compiled in).
  local root
  root=$(cat "$PACKED_ABS/SOURCE_ROOT" 2>/dev/null)
  if [ -n "$root" ] && [ "$(readlink -f "$root")" != "$PWD" ]; then
    if [ -e "$root" ] && [ ! -L "$root" ]; then
      echo "prelude: $root exists here and is not this checkout: test fixtures are read there" >&2
    else
      mkdir -p "$(dirname "$root")" 2>/dev/null && ln -sfn "$PWD" "$root" 2>/dev/null ||
        echo "prelude: could not link $root to this checkout: test fixtures may be missing" >&2
    fi
  fi
  # shardtrain's data: WikiText-2 and the GPT-2 tokenizer from the checkout, Fashion-MNIST if packed
  local data=$PACKED_ABS/data
  mkdir -p "$data"
  if [ ! -f "$data/wikitext-2/wiki.train.tokens" ]; then
    tar -C "$data" -xJf data/wikitext-2/wikitext-2-v1.tar.xz
  fi
  [ -f "$data/gpt2-tokenizer/encoder.json" ] || cp -r data/gpt2-tokenizer "$data/"
  if [ -d "$PACKED_ABS/fashion-mnist" ] && [ ! -e "$data/fashion-mnist" ]; then
    ln -sfn "$PACKED_ABS/fashion-mnist" "$data/fashion-mnist"
  fi
  export SHARDTRAIN_DATA_DIR=$data
  [ -e "$data/fashion-mnist" ] && export FASHION_MNIST=${FASHION_MNIST:-$data/fashion-mnist}
  export LD_LIBRARY_PATH="$PACKED_ABS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  st_link_missing
  # libcudnn.so.9 loads its engine libraries (libcudnn_cnn.so.9, ...) by name from its own folder
  if [ -e "$PACKED_ABS/libmissing/libcudnn.so.9" ]; then
    LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(dirname "$(readlink -f "$PACKED_ABS/libmissing/libcudnn.so.9")")"
  fi
  return 0
}

# Libraries the packed binaries need that the loader does not find here: each one, by name, from
# PACKED/libfallback (packed from the build machine), CUDA's folders or PyTorch's nvidia-* wheels,
# linked into PACKED/libmissing. Repeated, since a fallback library can need another.
st_link_missing() {
  local dir=$PACKED_ABS/libmissing site lib cand missing b
  mkdir -p "$dir"
  site=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
  case ":$LD_LIBRARY_PATH:" in *":$dir:"*) ;; *) export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$dir" ;; esac
  for _ in 1 2 3 4; do
    missing=$(for b in "$PACKED_ABS"/shardtrain "$PACKED_ABS"/test_* "$PACKED_ABS"/bench_* "$PACKED_ABS"/*.so; do
        [ -f "$b" ] && ldd "$b" 2>/dev/null; done | awk '/not found/ {print $1}' | sort -u)
    [ -n "$missing" ] || return 0
    for lib in $missing; do
      # shellcheck disable=SC2086  # $site: a list of folders
      for cand in "$PACKED_ABS/libfallback/$lib" /usr/local/cuda/lib64/"$lib" /usr/local/cuda/lib/"$lib" \
          /usr/local/cuda/targets/x86_64-linux/lib/"$lib" $(for s in $site; do
            ls "$s"/nvidia/*/lib/"$lib" "$s"/nvidia/cu*/lib/"$lib" "$s"/torch/lib/"$lib" 2>/dev/null; done); do
        if [ -e "$cand" ]; then ln -sfn "$(readlink -f "$cand")" "$dir/$lib"; echo "prelude: $lib from $cand"; break; fi
      done
    done
  done
  for b in "$PACKED_ABS"/shardtrain "$PACKED_ABS"/test_* "$PACKED_ABS"/bench_*; do
    [ -f "$b" ] && ldd "$b" | grep "not found" | sed "s|^|prelude: $(basename "$b") still lacks |"
  done
  return 0
}

# ---- results, logs and the summary ---------------------------------------------------------------
ST=$PACKED_ABS/shardtrain
export SHARDTRAIN=$ST
if dry; then
  SUM=/dev/null
  LOGS=${LOGS:-\$LOGS}
else
  st_prepare_build || return 1 2>/dev/null || exit 1
  mkdir -p "$OUT"
  SUM=$OUT/summary.txt
  if [ -z "${LOGS:-}" ]; then
    LOGS_TMP=$(mktemp -d "${TMPDIR:-/tmp}/shardtrain-bench.XXXXXX")  # removed by run.sh at the end
    LOGS=$LOGS_TMP/logs
  fi
  mkdir -p "$LOGS"
fi
if [ -z "${GPUS:-}" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  else GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); fi
  if dry && [ "$GPUS" = 0 ]; then GPUS=1; fi
fi
COMMIT=$(cat "$PACKED_ABS/COMMIT" 2>/dev/null || echo unknown)
COMMIT_ARGS=()
git rev-parse --git-dir > /dev/null 2>&1 || COMMIT_ARGS=(--commit "$COMMIT")
MPIRUN=(mpirun --bind-to none)
[ "$(id -u)" != 0 ] || MPIRUN+=(--allow-run-as-root)

# say TEXT...: a line of the summary (also printed; nothing under DRY_RUN=1)
say() { dry || echo "$*" | tee -a "$SUM"; }
# note TEXT...: a line of the summary that a dry run prints too, as a comment
note() { if dry; then echo "# $*"; else say "$@"; fi; }

# cap SECONDS: SECONDS, or less where DEADLINE (seconds from the start, unset: none) leaves less
# (what is left minus 15 s, at least 5), so that a run ends in time with its summary written
cap() {
  [ -n "${DEADLINE:-}" ] || { echo "$1"; return; }
  local left=$(( DEADLINE - ($(date +%s) - T0) - 15 ))
  [ "$left" -ge 5 ] || left=5
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

# json_str TEXT: TEXT as a JSON string
json_str() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\n'/\\n}
  printf '"%s"' "$s"
}

STEP_FAILS=0
# step NAME SECONDS CMD...: runs CMD (at most SECONDS, capped by DEADLINE) with its output in
# $LOGS/NAME.log, which starts with the command; appends {workload, step, command, exit, seconds}
# to $OUT/steps.jsonl; returns CMD's exit status. DRY_RUN=1: prints the command instead.
step() {
  local name=$1 t rc start
  t=$(cap "$2"); shift 2
  if dry; then q "$@"; return 0; fi
  start=$(date +%s)
  echo "+ $(q "$@")" > "$LOGS/$name.log"
  timeout -k 30 "$t" "$@" >> "$LOGS/$name.log" 2>&1
  rc=$?
  st_record "$name" "$rc" "$start" "$@"
  return "$rc"
}
# step_out NAME SECONDS FILE CMD...: as step, but CMD's standard output goes to FILE
step_out() {
  local name=$1 t file=$3 rc start
  t=$(cap "$2"); shift 3
  if dry; then echo "$(q "$@") > $file"; return 0; fi
  start=$(date +%s)
  echo "+ $(q "$@") > $file" > "$LOGS/$name.log"
  timeout -k 30 "$t" "$@" > "$file" 2>> "$LOGS/$name.log"
  rc=$?
  st_record "$name" "$rc" "$start" "$@"
  return "$rc"
}
st_record() {
  local name=$1 rc=$2 start=$3
  shift 3
  [ "$rc" = 0 ] || STEP_FAILS=$((STEP_FAILS + 1))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then say "$name: stopped by its time limit"; fi
  printf '{"workload": %s, "step": %s, "command": %s, "exit": %d, "seconds": %d}\n' \
    "$(json_str "${WORKLOAD:-}")" "$(json_str "$name")" "$(json_str "$(q "$@")")" "$rc" \
    $(( $(date +%s) - start )) >> "$OUT/steps.jsonl"
}

# grab NAME ERE [N]: the first N (default 20) lines of $LOGS/NAME.log matching ERE, into the summary
grab() { dry || grep -E -- "$2" "$LOGS/$1.log" 2>/dev/null | head -n "${3:-20}" | tee -a "$SUM"; }
# grab_tail NAME N: the last N lines of $LOGS/NAME.log, into the summary
grab_tail() { dry || tail -n "$2" "$LOGS/$1.log" 2>/dev/null | tee -a "$SUM"; }
# grab_from NAME ERE: $LOGS/NAME.log from the first line matching ERE to its end, into the summary
grab_from() { dry || sed -n "/$2/,\$p" "$LOGS/$1.log" 2>/dev/null | tee -a "$SUM"; }

# run_gtest PROGRAM [ERE]: runs PACKED/PROGRAM (5 minutes at most); says its exit status and
# GoogleTest's totals, and copies its lines matching ERE (default FAILED) into the summary
run_gtest() {
  step "$1" 300 "$PACKED_ABS/$1"
  local rc=$?
  dry && return 0
  say "$1 exit $rc: $(gtest_totals "$1")"
  grab "$1" "${2:-^\[  FAILED  \] [A-Za-z]}" 30
}
# gtest_totals NAME: GoogleTest's totals in $LOGS/NAME.log ("[  PASSED  ] 10 tests." ...), one line
gtest_totals() {
  grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$LOGS/$1.log" 2>/dev/null | sort -u | tr '\n' ' '
}

# ---- the machine, into the summary ---------------------------------------------------------------
if ! dry; then
  {
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
      echo "no nvidia-smi"
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); GPUs used: $GPUS"
    echo "cpu: $(nproc --all) cores, $(lscpu | sed -n 's/^Model name: *//p' | head -1);" \
      "host memory: $(free -g | awk '/^Mem:/ {print $2}') GiB"
    echo "build: commit $COMMIT; $(sed -n 1p "$PACKED_ABS/MANIFEST" 2>/dev/null)"
  } | tee -a "$SUM"
fi
