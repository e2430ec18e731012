#!/usr/bin/env bash
# llama.cpp's llama-server, built from the tree vendored in the llama-cpp-python 0.3.36 sdist.
#
#   benchmarks/llamacpp_cuda.sh pack SDIST.tar.gz [TARBALL]
#       (here, with network) trim the sdist's vendor/llama.cpp to what the llama-server target
#       needs and write it as an xz tarball (default benchmarks/llamacpp-src.tar.xz, ~4 MiB).
#       Get the sdist with
#         pip download --no-deps --no-binary :all: 'llama-cpp-python==0.3.36' -d /tmp/sdist
#       The tarball is a build input, not a source of the project: keep it out of git with
#         echo benchmarks/llamacpp-src.tar.xz >> .git/info/exclude
#       and carry it to the device machine (the `run` tool's carry: ["benchmarks/llamacpp-src.tar.xz"]).
#
#   benchmarks/llamacpp_cuda.sh build [--cpu] [TARBALL] [BUILD_DIR]
#       (anywhere, no network) unpack the tarball into BUILD_DIR (default /tmp/llamacpp) and build
#       the llama-server target: with CUDA for sm_90 (H100/H200; CMAKE_CUDA_ARCHITECTURES=90,
#       flash attention compiled in, which is llama.cpp's default, and llama-server run with
#       `-fa on`), or with --cpu a CPU-only build (the local check of the same tree).
#       Prints the binary's path on its last line. JOBS (default: all cores) sets the parallelism;
#       TARGET (default llama-server) other ninja targets, space-separated (e.g. "llama-server
#       llama-quantize", or one object file to check the flags).
#       The web UI is not built and no prebuilt one is fetched (no network on the device).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
default_tarball="$here/llamacpp-src.tar.xz"

pack() {
    local sdist=${1:?usage: llamacpp_cuda.sh pack SDIST.tar.gz [TARBALL]}
    local out=${2:-$default_tarball}
    local work
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    tar -xzf "$sdist" -C "$work"
    local tree
    tree=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
    [ -f "$tree/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $sdist" >&2; return 1; }
    # What llama-server's build does not read: documentation, example models and vocabularies,
    # tests, examples, the Python converters, CI files, earlier build trees, the web UI's sources
    # (its CMake file and templates stay: the server target links an empty UI), and the ggml
    # backends other than the CPU and CUDA ones.
    (cd "$tree" && rm -rf docs media examples tests benches pocs gguf-py conversion ci skills .github .devops \
        build build-* app convert_*.py \
        tools/ui/src tools/ui/tests tools/ui/static tools/ui/package-lock.json)
    find "$tree/models" -mindepth 1 -maxdepth 1 ! -name templates -exec rm -rf {} +
    find "$tree/models/templates" -type f ! -name 'muse-glimmer.jinja' -delete
    for backend in "$tree"/ggml/src/ggml-*/; do
        case $(basename "$backend") in ggml-cpu | ggml-cuda) ;; *) rm -rf "$backend" ;; esac
    done
    # ggml's CMake adds tests/ and examples/ only when asked; the root adds tests/, examples/ and
    # app/ only when asked (all off below).
    tar -C "$(dirname "$tree")" -cJf "$out" llama.cpp
    echo "$out ($(du -h "$out" | cut -f1))"
}

build() {
    local cpu=0
    if [ "${1:-}" = "--cpu" ]; then cpu=1; shift; fi
    local tarball=${1:-$default_tarball}
    local dir=${2:-/tmp/llamacpp}
    local jobs=${JOBS:-$(nproc)}
    [ -f "$tarball" ] || { echo "no $tarball: run 'llamacpp_cuda.sh pack SDIST' first (see the header)" >&2; return 1; }
    mkdir -p "$dir"
    if [ ! -f "$dir/llama.cpp/CMakeLists.txt" ]; then
        tar -xJf "$tarball" -C "$dir"
    fi
    local src="$dir/llama.cpp"
    local flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON
                 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON
                 -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF
                 -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF)
    local build_dir
    if [ "$cpu" = 1 ]; then
        build_dir="$src/build-cpu"
        flags+=(-DGGML_CUDA=OFF)
    else
        build_dir="$src/build-cuda"
        command -v nvcc >/dev/null || export PATH="$PATH:/usr/local/cuda/bin"
        command -v nvcc >/dev/null || { echo "nvcc not found (CUDA toolkit needed for the CUDA build)" >&2; return 1; }
        flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF
                -DGGML_CUDA_GRAPHS=ON)
        local toolkit="" rpath="" candidate
        for candidate in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
            if [ -n "$candidate" ] && [ -x "$candidate/bin/nvcc" ]; then toolkit=$candidate; break; fi
        done  # (nvcc on the PATH may be a wrapper script elsewhere)
        if [ ! -f "$toolkit/include/cublas_v2.h" ] && [ ! -f "$toolkit/targets/x86_64-linux/include/cublas_v2.h" ]; then
            # A toolkit without cuBLAS (the device image's): use the nvidia-cublas wheel's, which the
            # python3 with torch has (CUBLAS_ROOT: a directory with include/cublas_v2.h and lib/).
            local root=${CUBLAS_ROOT:-}
            if [ -z "$root" ]; then
                root=$(python3 -c 'import glob, os, nvidia
hits = [h for b in nvidia.__path__ for h in sorted(glob.glob(os.path.join(b, "*", "include", "cublas_v2.h")))]
print(os.path.dirname(os.path.dirname(hits[0])) if hits else "")' 2>/dev/null || true)
            fi
            [ -n "$root" ] && [ -f "$root/include/cublas_v2.h" ] ||
                { echo "no cuBLAS: neither in $toolkit nor in python3's nvidia packages (set CUBLAS_ROOT)" >&2; return 1; }
            local lib="$root/lib"
            flags+=("-DCUDA_cublas_LIBRARY=$(ls "$lib"/libcublas.so* | head -1)"
                    "-DCUDA_cublasLt_LIBRARY=$(ls "$lib"/libcublasLt.so* | head -1)"
                    "-DCMAKE_CXX_FLAGS=-I$root/include" "-DCMAKE_CUDA_FLAGS=-I$root/include")
            rpath="-Wl,-rpath,$lib -Wl,-rpath-link,$lib"
            echo "cuBLAS from $root" >&2
        fi
        # llama.cpp links the driver library for its VMM memory pool: the machine's libcuda, else
        # (a toolkit without stubs on a machine without a driver: the local check) no VMM pool.
        local driver
        driver=$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF}'; ls /usr/lib/x86_64-linux-gnu/libcuda.so* \
                   /usr/local/nvidia/lib64/libcuda.so* "$toolkit"/lib64/stubs/libcuda.so* 2>/dev/null || true) | head -1)
        if [ -n "$driver" ]; then
            flags+=("-DCUDA_cuda_driver_LIBRARY=$driver")
        else
            flags+=(-DGGML_CUDA_NO_VMM=ON)
            echo "no libcuda found: building without the VMM pool (GGML_CUDA_NO_VMM)" >&2
        fi
        # the binary finds the toolkit's runtime (and the wheel's cuBLAS) without LD_LIBRARY_PATH
        for dir in "$toolkit/lib64" "$toolkit/lib" "$toolkit/targets/x86_64-linux/lib"; do
            [ -d "$dir" ] && rpath="$rpath -Wl,-rpath,$dir"
        done
        flags+=("-DCMAKE_EXE_LINKER_FLAGS=${rpath# }")
    fi
    local generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    cmake -S "$src" -B "$build_dir" "${generator[@]}" "${flags[@]}" >"$build_dir.cmake.log" 2>&1 ||
        { tail -30 "$build_dir.cmake.log" >&2; return 1; }
    local targets
    read -r -a targets <<<"${TARGET:-llama-server}"
    cmake --build "$build_dir" --target "${targets[@]}" -j "$jobs" >"$build_dir.build.log" 2>&1 ||
        { tail -40 "$build_dir.build.log" >&2; return 1; }
    echo "$build_dir/bin/llama-server"
}

case ${1:-} in
    pack) shift; pack "$@" ;;
    build) shift; build "$@" ;;
    *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
