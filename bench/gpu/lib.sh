# Shared by bench/gpu/*.sh (sourced, not run): the repository root as the working directory, OUT made
# absolute, and `step`, which runs one command with its console log under LOGDIR.
#
#   step NAME CMD...   runs CMD, its stdout and stderr to $LOGDIR/NAME.log; prints "=== NAME rc=RC S s" and
#                      the log's last $TAIL lines (progress bars and Ray's C++ logging left out); counts
#                      failures in $failed. With DRY=1 it prints the command and runs nothing.
set -u
if [ $# -lt 1 ] || [ -z "$1" ]; then
  sed -n '2,/^set -u/p' "$0" | sed -n '/^#/s/^# \{0,1\}//p' >&2  # the calling script's header is its usage
  exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # `python -m bench...` needs the repository root
logs=${LOGDIR:-$out/logs}
mkdir -p "$logs"
failed=0
TAIL=${TAIL:-25}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python)}  # the one with torch (and Ray for the job)

step() {
  local name=$1; shift
  echo "=== $name: $*"
  if [ "${DRY:-0}" = 1 ]; then return 0; fi
  local t0=$SECONDS rc=0
  ( "$@" ) > "$logs/$name.log" 2>&1 || rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0)) s"
  tr '\r' '\n' < "$logs/$name.log" | grep -v '%\|logging.cc\|^ *@' | tail -n "$TAIL"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

gpus() {  # the GPUs this process sees (0 without a driver)
  if [ "${DRY:-0}" = 1 ]; then echo "${DRY_GPUS:-1}"; return; fi
  nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
}

probe() {  # NAME MODEL RANK ARGS...: one bench.probes.cold_read run (the caller sets tp, repeats, adapters), its
  # JSON at OUT/NAME.json
  local name=$1 model=$2 rank=$3; shift 3
  step "$name" "$PYTHON" -m bench.probes.cold_read --model "$model" --rank "$rank" --tp "$tp" --repeats "$repeats" \
       --adapters "$adapters/lora-cache-cold-$model-r$rank" --out "$out/$name.json" "$@"
}
