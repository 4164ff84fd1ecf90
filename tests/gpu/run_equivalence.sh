#!/usr/bin/env bash
# Runs the strategy equivalence suite (tests/gpu/equivalence.py) on the GPUs of this machine and
# writes its Markdown report; exits non-zero when any check fails (or nothing could run).
#
#   tests/gpu/run_equivalence.sh REPORT.md [more equivalence.py flags, e.g. --only 'gpt2-fp32']
#
# GPUS=N         GPUs to use (default: those CUDA_VISIBLE_DEVICES names, else every GPU that
#                `nvidia-smi -L` lists; N >= 1, checks that need more are skipped and listed)
# SHARDTRAIN=BIN the binary (default: build/shardtrain of this repository, else `shardtrain` on
#                the PATH)
# WORK=DIR       the suite's work directory: every run's command, log and metrics (default:
#                REPORT without .md, plus .work)
# Needs python3 with numpy. For the CPU form (MPI ranks) call equivalence.py directly:
#   python3 tests/gpu/equivalence.py --device cpu --ranks 2 --report report-cpu.md
set -uo pipefail
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: $0 REPORT.md [equivalence.py flags]" >&2
  exit 2
fi
report=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "${GPUS:-}" ]; then
  gpus=$GPUS
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  gpus=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
elif command -v nvidia-smi > /dev/null; then
  gpus=$(nvidia-smi -L | wc -l)
else
  gpus=0
fi
if ! [ "$gpus" -ge 1 ] 2> /dev/null; then
  echo "$0: no GPU found (nvidia-smi -L lists none; set GPUS=N to override)" >&2
  exit 2
fi
for a in "$@"; do
  [ "$a" != --list ] || exec python3 "$here/equivalence.py" --device cuda --gpus "$gpus" "$@"
done
work=${WORK:-${report%.md}.work}
export PYTHONUNBUFFERED=1
rm -f "$report"
python3 "$here/equivalence.py" --device cuda --gpus "$gpus" --work-dir "$work" \
  --report "$report" "$@"
status=$?
[ -f "$report" ] || { echo "$0: no report written" >&2; [ $status -ne 0 ] || status=1; }
exit $status
