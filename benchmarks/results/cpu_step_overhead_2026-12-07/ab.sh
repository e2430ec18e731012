#!/bin/bash
# Same-run A/B: outside_products.py (or $SCRIPT) in the base tree ($BASE, a `git archive` of
# the base commit) and in $NEW (default: this checkout), interleaved for $ROUNDS rounds; one
# JSON line a run, tagged base/new. Extra arguments go to the script.
#   BASE=/tmp/stepcost_base [NEW=/tmp/stepcost_new] ROUNDS=3 ./ab.sh --model FILE [--threads 1] ...
set -e
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
NEW=${NEW:-$HERE}
SCRIPT=${SCRIPT:-$HERE/benchmarks/results/cpu_step_overhead_2026-12-07/outside_products.py}
for r in $(seq 1 "${ROUNDS:-3}"); do
  for side in base new; do
    if [ $side = base ]; then tree=$BASE; else tree=$NEW; fi
    out=$(cd /tmp && PYTHONPATH="$tree:$tree/plugins/cuda:$tree/benchmarks" python "$SCRIPT" "$@")
    echo "{\"round\": $r, \"side\": \"$side\", \"result\": $out}"
  done
done
