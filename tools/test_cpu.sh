#!/usr/bin/env bash
# The CPU tests in two pytest processes at once, which is what CI runs:
#
#   bash tools/test_cpu.sh                       # tests/cpu
#   bash tools/test_cpu.sh tests/cpu/test_ops.py -k gather   # these files; options go to both
#   PYTHON=/path/to/python bash tools/test_cpu.sh             # another interpreter (tools/test_newest.sh)
#
# Why two: the tests on a fake process group and in Triton's interpreter compile and run in one
# process on one core (97 s of CPU in 99 s), while the gloo tests' ranks keep both cores busy
# (215 s of CPU in 119 s); side by side they share CI's two cores where one after another
# (`python3 -m pytest tests/cpu`, the same tests) a core would idle. Files whose tests start gloo
# ranks (`*_gloo.py`, the rank pool's, the demo's) form one process, every other file the
# other. Each process writes a log, printed whole when both are done; the exit status is the
# first failing one's.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

files=() options=()
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then files+=("$arg"); else options+=("$arg"); fi
done
[ ${#files[@]} -eq 0 ] && files=(tests/cpu)

# expand folders into their test files, so that each file goes to one process
expanded=()
for f in "${files[@]}"; do
  if [ -d "$f" ]; then expanded+=("$f"/test_*.py); else expanded+=("$f"); fi
done

ranks=() single=()
for f in "${expanded[@]}"; do
  case "$(basename "${f%%::*}")" in
    *_gloo.py | test_rank_pool.py | test_demo.py) ranks+=("$f") ;;
    *) single+=("$f") ;;
  esac
done

logs=$(mktemp -d)
pids=() names=()
run() {  # name, files...
  local name=$1
  shift
  [ $# -eq 0 ] && return
  "$PYTHON" -m pytest -q -p no:cacheprovider "$@" ${options[@]+"${options[@]}"} >"$logs/$name.log" 2>&1 &
  pids+=($!)
  names+=("$name")
}
run ranks ${ranks[@]+"${ranks[@]}"}
run single ${single[@]+"${single[@]}"}

status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  echo "=== ${names[$i]}: ${#pids[@]} processes side by side; this one's log (exit $rc) ==="
  cat "$logs/${names[$i]}.log"
  # 5: every test of this process deselected (by -k), which is not a failure
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && [ "$status" -eq 0 ]; then status=$rc; fi
done
rm -rf "$logs"
exit "$status"
