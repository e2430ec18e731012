#!/usr/bin/env bash
# The musegl side of the agent workload (llamacpp_cuda_compare.py --sides musegl) with the worker's
# timeline (--trace-steps) and py-spy samples of the worker and the front while the agent turns run.
#
#   benchmarks/agent_profile.sh OUT NAME [extra llamacpp_cuda_compare.py flags...]
#
# MODEL (default /tmp/cfg26: make_gguf_30b.py --config-only --layers 26), TURNS (5), MAX_TOKENS (128),
# CONVERSATIONS (32), SPY_SECONDS (20; 0: no py-spy) and T (the compare's time cap, 200 s) size it.
# Writes OUT/NAME.jsonl (the figures), OUT/NAME_trace.jsonl (benchmarks/trace_report.py reads it),
# OUT/NAME_server.log (the server's log and the script's stderr), OUT/NAME_metrics.txt (/metrics after
# the agent part) and, with py-spy on the path, OUT/NAME_spy.tgz (raw collapsed stacks per process).
set -uo pipefail
out=${1:?usage: agent_profile.sh OUT NAME [flags...]}; name=${2:?usage: agent_profile.sh OUT NAME [flags...]}
shift 2
model=${MODEL:-/tmp/cfg26}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 "$here/make_gguf_30b.py" --config-only --layers 26 --config-out "$model" >/dev/null
trace="$out/${name}_trace.jsonl"
rm -f "$trace" /tmp/musegl-serve-*.log
spy_dir=$(mktemp -d)
if [ "${SPY_SECONDS:-20}" != 0 ] && command -v py-spy >/dev/null; then
    (   # once the agent turns begin (the first request of a bench session reaches the worker)
        for _ in $(seq 1 1500); do grep -q '"session":"bench-' "$trace" 2>/dev/null && break; sleep 0.2; done
        worker=$(pgrep -f musegl_core.worker.main | head -1)
        front=$(pgrep -f "musegl_core.cli.main serve" | head -1)
        for pair in "worker:$worker" "front:$front"; do
            [ -n "${pair#*:}" ] && py-spy record --pid "${pair#*:}" --duration "${SPY_SECONDS:-20}" --rate 100 \
                --threads --nonblocking --format raw -o "$spy_dir/${pair%%:*}.raw" >"$spy_dir/${pair%%:*}.log" 2>&1 &
        done
        wait
    ) &
    spy=$!
fi
timeout "${T:-200}" python3 "$here/llamacpp_cuda_compare.py" --model "$model" --sides musegl \
    --conversations "${CONVERSATIONS:-32}" --turns "${TURNS:-5}" --shared-system-tokens 12000 --prompt-tokens 500 \
    --max-tokens "${MAX_TOKENS:-128}" --decode-concurrency 1,32 --decode-max-tokens 128 \
    --musegl-flag="--trace-steps=$trace" --out "$out/$name.jsonl" --metrics-out "$out/${name}_metrics.txt" "$@" \
    2>"$out/${name}_stderr.txt"
status=$?
cat /tmp/musegl-serve-*.log "$out/${name}_stderr.txt" >"$out/${name}_server.log" 2>/dev/null
rm -f "$out/${name}_stderr.txt"
if [ -n "${spy:-}" ]; then
    kill "$spy" 2>/dev/null; wait "$spy" 2>/dev/null
    tar -czf "$out/${name}_spy.tgz" -C "$spy_dir" . 2>/dev/null
fi
rm -rf "$spy_dir"
exit $status
