#!/usr/bin/env bash
# The same benchmark on two trees in turns, in one process run after another on one machine: a
# before/after that a shared, noisy GPU cannot fake by drifting between two calls.
#
#   bench/compare_trees.sh REV [ROUNDS] [-- SCRIPT ARGS...]
#   bench/compare_trees.sh e6b98e8 3 -- bench/engine.py --batches 64,1 --steps 64 --no-hf --prefill-prompt 0
#
# REV is exported (git archive) beside a temporary directory and run with its own packages; the
# working tree is the other side. Each JSON row a run prints is tagged "<rev|tree> <round>". $PYTHON
# picks the interpreter (default python3).
set -euo pipefail
rev=${1:?usage: bench/compare_trees.sh REV [ROUNDS] [-- SCRIPT ARGS...]}
shift
rounds=3
if [[ $# -gt 0 && $1 != -- ]]; then rounds=$1; shift; fi
[[ ${1:-} == -- ]] && shift
[[ $# -gt 0 ]] || set -- bench/engine.py --batches 64,1 --steps 64 --no-hf --prefill-prompt 0
root=$(git rev-parse --show-toplevel)
before=$(mktemp -d)
trap 'rm -rf "$before"' EXIT
git -C "$root" archive "$rev" | tar -x -C "$before"
for ((round = 1; round <= rounds; round++)); do
  for side in "$rev" tree; do
    dir=$root
    [[ $side == "$rev" ]] && dir=$before
    (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 "${PYTHON:-python3}" "$@") \
      | grep '^{' | sed "s/^/$side $round /"
  done
done
