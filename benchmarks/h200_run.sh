#!/usr/bin/env bash
# The H200 run of issue 32 in three commands of under 9 minutes each, on one warm machine
# (the files of stage 1 live in /tmp/h200 and are gone if the machine is given back).
#
#   benchmarks/h200_run.sh build     # llama-server (CUDA, sm_90) and the reduced-depth GGUF, in the
#                                    # background; meanwhile the GPU tests (-m gpu) and served DFlash
#                                    # at acceptance 2/4/8/16 x batch 1/8/32 (gpu_decode --phases dflash)
#   benchmarks/h200_run.sh decode    # gpu_decode.py (full depth): executor decode at 512/8k/32k/128k x
#                                    # 1/8/32/64 and 128/256 at 2k, prefill, 32k TTFT; then served
#                                    # levels, 32k TTFT, rows (JSON schema, logprobs); waits for
#                                    # stage 1's jobs first (up to 2 minutes)
#   benchmarks/h200_run.sh compare   # the agent workload and plain decode, musegl vs llama-server
#   benchmarks/h200_run.sh agentx    # issue 45: the agent workload in the AgentX shape (llamacpp_cuda_compare.py
#                                    # --preset agentx: sessions growing past 100K, subagents), musegl (host
#                                    # tier) vs llama-server --cache-ram; needs stage 1's jobs (jobs or build)
#   benchmarks/h200_run.sh q4km      # issue 48: Q4_K_M decode at 1 and 32 requests (Q4KM_CONCURRENCY), musegl
#                                    # serving the file that stage 1's llama-quantize wrote from its GGUF (as
#                                    # stored) vs llama-server on it; needs stage 1's jobs (jobs or build)
#   benchmarks/h200_run.sh restore   # issue 45: kv_restore.py on CUDA, a 131K-token session restored from the
#                                    # host tier vs re-prefilled, at RESTORE_LAYERS (default 26) layers
#   benchmarks/h200_run.sh probe     # gpu_gemv.py (the four weight products: cuBLAS vs a Triton kernel),
#                                    # then the executor phase of gpu_decode.py as in decode, profiled
#   benchmarks/h200_run.sh exec CMD  # CMD (e.g. one gpu_decode.py phase with other flags) in the same setup
#   benchmarks/h200_run.sh jobs      # only stage 1's background jobs (llama-server build, the GGUF): then
#                                    # exec parts beside them, and compare (which waits for them)
#
# Each writes JSON lines (and logs) into $OUT (default ./h200_out). Run from the repository root
# with the `run` tool's carry: [".whl", "benchmarks/llamacpp-src.tar.xz"] (the wheels the device
# lacks, gguf among them; the trimmed llama.cpp tree: benchmarks/llamacpp_cuda.sh pack).
# LAYERS (default 26) is the depth of the llama.cpp comparison, the same for both servers (the
# full 52-layer GGUF is ~53 GB, the disk 64 GiB); gpu_decode runs the full depth.
# T_TESTS, T_DFLASH, T_EXECUTOR, T_SERVED, T_COMPARE (seconds) cap each part; GPU_TESTS names the test
# paths of stage 1; SERVE_CONCURRENCY, COMPARE_TURNS and COMPARE_MAX_TOKENS size the served levels and the
# agent workload; SIDES (default musegl,llamacpp) picks the compare stage's servers.
# PROFILE=1 adds gpu_decode's --profile (torch.profiler tables of the executor's prefill and decode points
# on stderr, and of the served plain/DFlash steps in $OUT/profiles; the probe stage always profiles).
# agentx: AGENTX_SESSIONS (8), AGENTX_TURNS (4), AGENTX_SUBAGENTS (4), AGENTX_CONTEXT (88000: each session's own
# context on top of 12K system + tools), AGENTX_GROWTH (2000 user tokens a turn, as many of tool results),
# AGENTX_CONCURRENCY (4 requests in flight; llama-server's -np), CACHE_RAM (MiB, 32768) and KV_OFFLOAD (32GiB)
# the two servers' host RAM, T_AGENTX (500 s); LLAMA_SERVER a llama-server binary of a tree built elsewhere.
# Both sides may not fit one call: SIDES=musegl, then SIDES=llamacpp on the same warm machine; the second
# takes the first's lines from $WORK/agentx.jsonl for the ratios (llamacpp_cuda_compare.py --previous).
# restore: RESTORE_LAYERS, RESTORE_TOKENS (130816: the history; with its next turn inside the 131,072
# positions), RESTORE_FLAGS (more kv_restore.py flags, e.g. "--kv-cache-dtype fp8"), T_RESTORE (480 s).
# SMOKE=1 runs the same three stages on the CPU at the tiny shape with small counts (the local
# check of this script; the GPU tests are skipped; WORK=/tmp/h200 and SITE=/tmp/site unless set).
set -uo pipefail

stage=${1:?usage: h200_run.sh build|decode|compare|q4km|agentx|restore|probe|jobs|exec CMD...}
shift
OUT=${OUT:-$PWD/h200_out}
LAYERS=${LAYERS:-26}
WORK=${WORK:-/tmp/h200}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
    shape=(--device cpu --tiny)
    build_flag=(--cpu); binary=build-cpu; gguf_shape=(--tiny)
    executor_args=(--contexts 64,256 --batches 1,4 --wide-batches 8 --wide-context 128 --steps 6
                   --prefill-tokens 128 --prefill-repeat 1 --ttft-tokens 512 --prefill-chunk 128)
    served_args=(--ttft-tokens 512 --serve-concurrency 1,2 --serve-max-tokens 8 --serve-prompt-tokens 64
                 --rows-batch 4 --rows-max-tokens 8)
    dflash_args=(--serve-prompt-tokens 64 --dflash-batches 1,2 --dflash-accept 4,2 --dflash-max-tokens 16)
    compare_args=(--device cpu --threads 2 --conversations 2 --turns 2 --shared-system-tokens 300 --prompt-tokens 40
                  --max-tokens 8 --decode-concurrency 1,2 --decode-max-tokens 8 --decode-prompt-tokens 64)
    agentx_args=(--device cpu --threads 2 --conversations 2 --turns 2 --subagents 1 --subagent-turns 2
                 --shared-system-tokens 300 --context-tokens 600 --subagent-context-tokens 200 --prompt-tokens 40
                 --max-tokens 8 --concurrency 2 --cache-ram 64 --kv-offload-memory 64MiB)
    restore_args=(--device cpu --tiny --tokens 512 --turn 8)
    q4km_args=(--device cpu --threads 2 --decode-max-tokens 8 --decode-prompt-tokens 64)
else
    q4km_args=()
    shape=()
    build_flag=(); binary=build-cuda; gguf_shape=(--layers "$LAYERS")
    executor_args=(--contexts 512,8192,32768,131072 --batches 1,8,32,64 --wide-batches 128,256 --wide-context 2048
                   --forward-sizes 1,2,4,8,16,32,64,128,256 --ttft-tokens 32768 --ttft-chunks "${TTFT_CHUNKS:-8192}")
    served_args=(--ttft-tokens 32768 --serve-concurrency "${SERVE_CONCURRENCY:-1,8,32,64}" --rows-batch 64)
    dflash_args=(--dflash-batches 1,8,32 --dflash-accept 4,16,2,8 --dflash-max-tokens 256)  # (the order they run in)
    # both sides' plain decode (first, short) and agent part within T_COMPARE: llama-server took 357 s
    # for 6 turns of the agent workload at 26 layers (32 conversations, 12k system + tools, 500 + 128
    # a turn), so the stage runs COMPARE_TURNS (default 5) of the issue's 10; 10 need about a stage per side
    # (SIDES=musegl, then SIDES=llamacpp)
    compare_args=(--conversations 32 --turns "${COMPARE_TURNS:-5}" --shared-system-tokens 12000 --prompt-tokens 500
                  --max-tokens "${COMPARE_MAX_TOKENS:-128}" --decode-concurrency 1,32 --decode-max-tokens 128)
    agentx_args=(--conversations "${AGENTX_SESSIONS:-8}" --turns "${AGENTX_TURNS:-4}" --subagents "${AGENTX_SUBAGENTS:-4}"
                 --context-tokens "${AGENTX_CONTEXT:-88000}" --prompt-tokens "${AGENTX_GROWTH:-2000}"
                 --concurrency "${AGENTX_CONCURRENCY:-4}" --cache-ram "${CACHE_RAM:-32768}"
                 --kv-offload-memory "${KV_OFFLOAD:-32GiB}")
    # shellcheck disable=SC2206  # (RESTORE_FLAGS: more flags, split on spaces)
    restore_args=(--device cuda --layers "${RESTORE_LAYERS:-26}" --tokens "${RESTORE_TOKENS:-130816}" ${RESTORE_FLAGS:-})
fi
profile=()
[ "${PROFILE:-0}" = 1 ] && profile=(--profile --profile-at "${PROFILE_AT:-512x1,512x64,32768x1}")
mkdir -p "$OUT" "$WORK"
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
cd "$root"
export PYTHONUNBUFFERED=1

setup() {
    # The carried wheels, and musegl with the plugins it serves with (entry points) in /tmp/site;
    # the repository's own directories come first on the path, so the tree's code runs.
    local site=${SITE:-/tmp/site}
    if [ ! -f "$site/.musegl-installed" ]; then
        if [ "$SMOKE" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then  # (SMOKE: this machine's venv has them)
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
                .whl/*.whl || return 1
        fi
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" \
            . plugins/cuda plugins/dflash plugins/atem >"$WORK/install.log" 2>&1 || { tail -20 "$WORK/install.log"; return 1; }
        touch "$site/.musegl-installed"
    fi
    export PYTHONPATH="$root:$root/plugins/cuda:$root/plugins/dflash:$root/plugins/atem:$site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$site/bin:$PATH"
}

# every server the Python scripts start writes its process group here (benchmarks/common.py); after
# each timed part, reap stops the groups still alive (a script killed before its cleanup ran)
export MUSEGL_BENCH_SERVER_GROUPS="$WORK/server_groups.$stage"
: >"$MUSEGL_BENCH_SERVER_GROUPS"
reap() {  # reap PART: stop the servers PART left behind, say which
    local left
    left=$(python3 "$here/common.py" reap "$MUSEGL_BENCH_SERVER_GROUPS")
    [ -z "$left" ] || note "\"part\": \"$1\", \"reaped_server_groups\": \"$left\""
}

note() { echo "{\"stage\": \"$stage\", $1}" | tee -a "$OUT/h200_run.jsonl"; }

wait_for() {  # wait_for NAME SECONDS: a background job of stage 1 (its .done file holds its status)
    local name=$1 limit=$2 waited=0
    if [ ! -f "$WORK/$name.done" ] && [ ! -f "$WORK/$name.log" ]; then  # never started (no build stage here)
        note "\"job\": \"$name\", \"status\": \"not started\""
        return 1
    fi
    while [ ! -f "$WORK/$name.done" ] && [ "$waited" -lt "$limit" ]; do sleep 5; waited=$((waited + 5)); done
    if [ -f "$WORK/$name.done" ]; then
        note "\"job\": \"$name\", \"status\": $(cat "$WORK/$name.done"), \"waited_s\": $waited"
    else
        note "\"job\": \"$name\", \"status\": \"running\", \"waited_s\": $waited"
        return 1
    fi
}

background() {  # background NAME COMMAND...: run in its own session (it outlives this command)
    local name=$1; shift
    rm -f "$WORK/$name.done"
    setsid nohup bash -c '"$@" >"'"$WORK/$name.log"'" 2>&1; echo $? >"'"$WORK/$name.done"'"' _ "$@" </dev/null \
        >/dev/null 2>&1 &
}

setup || { note "\"error\": \"setup failed\""; exit 1; }
start_jobs() {
    background llamacpp env JOBS=$(( $(nproc) > 2 ? $(nproc) - 2 : 1 )) TARGET="llama-server llama-quantize" nice -n 10 \
        "$here/llamacpp_cuda.sh" build "${build_flag[@]}" "$here/llamacpp-src.tar.xz" "$WORK/llamacpp"
    background gguf python3 "$here/make_gguf_30b.py" "$WORK/model.gguf" "${gguf_shape[@]}" --config-out "$WORK/model"
    # issue 48: the same GGUF through llama.cpp's own llama-quantize, once both jobs above are done
    background q4km bash -c 'while [ ! -f "$1/gguf.done" ] || [ ! -f "$1/llamacpp.done" ]; do sleep 5; done
        [ "$(cat "$1/gguf.done")" = 0 ] && [ "$(cat "$1/llamacpp.done")" = 0 ] || exit 1
        "$1/llamacpp/llama.cpp/$2/bin/llama-quantize" "$1/model.gguf" "$1/model-q4_k_m.gguf" Q4_K_M "$(nproc)"' \
        _ "$WORK" "$binary"
}

case $stage in
jobs)
    start_jobs
    note "\"jobs\": \"started\""
    ;;
build)
    if [ "$SMOKE" = 1 ]; then echo cpu | tee "$OUT/gpu.txt"; else
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"; fi
    df -h /tmp | tail -1 | tee -a "$OUT/gpu.txt"
    start_jobs
    if [ "$SMOKE" = 1 ]; then
        note "\"gpu_tests\": \"skipped (SMOKE)\""
    else
        timeout -k 40 "${T_TESTS:-270}" python3 -m pytest -m gpu -q -n 0 -p no:cacheprovider ${GPU_TESTS:-plugins/cuda/tests plugins/dflash/tests} \
            >"$OUT/gpu_tests.log" 2>&1
        note "\"gpu_tests_rc\": $?, \"summary\": \"$(tail -1 "$OUT/gpu_tests.log" | tr -d '"')\""
    fi
    # served DFlash here, beside the build: both sides of each ratio (DFlash / the same requests
    # without a draft) are measured in this same stage
    timeout -k 40 "${T_DFLASH:-210}" python3 "$here/gpu_decode.py" --phases dflash "${shape[@]}" "${dflash_args[@]}" "${profile[@]}" \
        --out "$OUT/gpu_decode.jsonl" 2>"$OUT/gpu_decode_dflash.stderr"
    note "\"gpu_decode_dflash_rc\": $?"
    reap dflash
    wait_for gguf 10
    wait_for llamacpp 20
    cp "$WORK"/*.log "$OUT/" 2>/dev/null
    ;;
decode)
    wait_for gguf 30
    wait_for llamacpp 90  # (a build still running goes on beside the measurements, at nice 10)
    timeout -k 40 "${T_EXECUTOR:-220}" python3 "$here/gpu_decode.py" --phases executor "${shape[@]}" "${executor_args[@]}" "${profile[@]}" \
        --out "$OUT/gpu_decode.jsonl" 2>"$OUT/gpu_decode_executor.stderr"
    note "\"gpu_decode_executor_rc\": $?"
    reap executor
    timeout -k 40 "${T_SERVED:-180}" python3 "$here/gpu_decode.py" --phases "${SERVED_PHASES:-serve,rows}" "${shape[@]}" "${served_args[@]}" "${profile[@]}" \
        --out "$OUT/gpu_decode.jsonl" 2>"$OUT/gpu_decode_served.stderr"
    note "\"gpu_decode_served_rc\": $?"
    reap served
    cp "$WORK"/*.log "$OUT/" 2>/dev/null
    ;;
compare)
    if [ -f "$WORK/gguf.log" ] || [ -f "$WORK/llamacpp.log" ]; then  # stage 1's jobs ran here: wait for them
        wait_for gguf "${WAIT_JOBS:-120}"
        wait_for llamacpp "${WAIT_JOBS:-120}"
    fi
    server="$WORK/llamacpp/llama.cpp/$binary/bin/llama-server"
    sides=${SIDES:-musegl,llamacpp}
    if [ ! -x "$server" ] || [ ! -f "$WORK/model.gguf" ]; then
        note "\"error\": \"no llama-server or GGUF from stage 1 (see llamacpp.log, gguf.log): musegl side only\""
        sides=musegl
        python3 "$here/make_gguf_30b.py" --config-only "${gguf_shape[@]}" --config-out "$WORK/model"
    fi
    timeout -k 40 "${T_COMPARE:-520}" python3 "$here/llamacpp_cuda_compare.py" --llama-server "$server" --gguf "$WORK/model.gguf" \
        --model "$WORK/model" --sides "$sides" \
        --chat-template "$WORK/llamacpp/llama.cpp/models/templates/muse-glimmer.jinja" "${compare_args[@]}" \
        --out "$OUT/llamacpp_compare.jsonl" 2>"$OUT/llamacpp_compare.stderr"
    rc=$?
    reap compare
    note "\"compare_rc\": $rc, \"layers\": \"$([ "$SMOKE" = 1 ] && echo tiny || echo "$LAYERS")\""
    ;;
q4km)
    # issue 48: Q4_K_M decode at 1 and 32 concurrent requests, musegl serving the file llama.cpp's
    # llama-quantize wrote (its matrices as stored) vs llama-server on the same file
    wait_for q4km "${WAIT_JOBS:-300}"
    server="$WORK/llamacpp/llama.cpp/$binary/bin/llama-server"
    timeout -k 40 "${T_COMPARE:-520}" python3 "$here/llamacpp_cuda_compare.py" --llama-server "$server" \
        --gguf "$WORK/model-q4_k_m.gguf" --musegl-checkpoint "$WORK/model-q4_k_m.gguf" --model "$WORK/model" \
        --sides "${SIDES:-musegl,llamacpp}" --no-agent --no-tools --conversations 1 --slot-context 1024 \
        --decode-concurrency "${Q4KM_CONCURRENCY:-1,32}" --decode-max-tokens "${COMPARE_MAX_TOKENS:-128}" \
        --chat-template "$WORK/llamacpp/llama.cpp/models/templates/muse-glimmer.jinja" "${q4km_args[@]}" \
        --previous "$WORK/q4km.jsonl" --out "$OUT/q4km_compare.jsonl" 2>"$OUT/q4km_compare.stderr"
    rc=$?
    cat "$OUT/q4km_compare.jsonl" >>"$WORK/q4km.jsonl" 2>/dev/null
    reap q4km
    note "\"q4km_rc\": $rc, \"layers\": \"$([ "$SMOKE" = 1 ] && echo tiny || echo "$LAYERS")\""
    ;;
agentx)
    if [ -f "$WORK/gguf.log" ] || [ -f "$WORK/llamacpp.log" ]; then  # stage 1's jobs ran here: wait for them
        wait_for gguf "${WAIT_JOBS:-120}"
        [ -n "${LLAMA_SERVER:-}" ] || wait_for llamacpp "${WAIT_JOBS:-120}"
    fi
    server=${LLAMA_SERVER:-$WORK/llamacpp/llama.cpp/$binary/bin/llama-server}
    tree=$(dirname "$(dirname "$(dirname "$server")")")  # (TREE/BUILD/bin/llama-server)
    sides=${SIDES:-musegl,llamacpp}
    if [ ! -f "$WORK/model/config.json" ]; then
        python3 "$here/make_gguf_30b.py" --config-only "${gguf_shape[@]}" --config-out "$WORK/model"
    fi
    if [ ! -x "$server" ] || [ ! -f "$WORK/model.gguf" ]; then
        note "\"error\": \"no llama-server or GGUF from stage 1 (see llamacpp.log, gguf.log): musegl side only\""
        sides=musegl
    fi
    timeout -k 40 "${T_AGENTX:-500}" python3 "$here/llamacpp_cuda_compare.py" --preset agentx --llama-server "$server" \
        --gguf "$WORK/model.gguf" --model "$WORK/model" --sides "$sides" \
        --chat-template "$tree/models/templates/muse-glimmer.jinja" "${agentx_args[@]}" \
        --previous "$WORK/agentx.jsonl" --out "$OUT/agentx.jsonl" 2>"$OUT/agentx.stderr"
    rc=$?
    cat "$OUT/agentx.jsonl" >>"$WORK/agentx.jsonl" 2>/dev/null  # (a later call's --previous: SIDES one at a time)
    reap agentx
    note "\"agentx_rc\": $rc, \"layers\": \"$([ "$SMOKE" = 1 ] && echo tiny || echo "$LAYERS")\", \"sides\": \"$sides\""
    ;;
restore)
    timeout -k 40 "${T_RESTORE:-480}" python3 "$here/kv_restore.py" "${restore_args[@]}" --out "$OUT/kv_restore.jsonl" \
        2>"$OUT/kv_restore.stderr"
    rc=$?
    note "\"kv_restore_rc\": $rc"
    ;;
probe)
    if [ "$SMOKE" = 1 ]; then note "\"gpu_gemv\": \"skipped (SMOKE)\""; else
        timeout -k 20 "${T_GEMV:-150}" python3 "$here/gpu_gemv.py" >"$OUT/gpu_gemv.jsonl" 2>"$OUT/gpu_gemv.stderr"
        note "\"gpu_gemv_rc\": $?"
    fi
    [ ${#profile[@]} -gt 0 ] || profile=(--profile --profile-at "${PROFILE_AT:-512x1,512x64,32768x1}")
    timeout -k 40 "${T_EXECUTOR:-220}" python3 "$here/gpu_decode.py" --phases executor "${shape[@]}" "${executor_args[@]}" "${profile[@]}" \
        --out "$OUT/gpu_decode.jsonl" 2>"$OUT/gpu_decode_executor.stderr"
    note "\"gpu_decode_executor_rc\": $?"
    reap executor
    ;;
exec)
    [ $# -gt 0 ] || { echo "exec needs a command" >&2; exit 2; }
    "$@"
    rc=$?
    reap exec
    note "\"exec_rc\": $rc, \"command\": \"$(echo "$*" | tr -d '"\\')\""
    ;;
*)
    echo "unknown stage $stage (build, decode, compare, q4km, agentx, restore, probe, jobs or exec)" >&2; exit 2 ;;
esac
