"""The stored-weight kernels built with other compiler flags, timed against each other.

Builds ``weight_kernels.c`` (``$SRC``: default this checkout's) once per variant of extra
compiler flags and times ``mw_matmul`` of one random ``DTYPE`` matrix of ``N x K`` by ``ROWS``
activation rows on ``THREADS`` threads, the variants interleaved, 11 times each: thread CPU
time on one thread (load-robust), wall time on more; prints the median and whether each
variant's result equals the first's bit for bit.

    python benchmarks/cpu_kernel_variants.py DTYPE NxK ROWS THREADS "FLAGS" ["FLAGS" ...]
    e.g. python benchmarks/cpu_kernel_variants.py q6_k 202048x1024 1 1 "-DMW_KQUANT_FLOAT" ""
"""
import ctypes, subprocess, sys, time, statistics, os, hashlib
from pathlib import Path
import numpy as np
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins/cuda/tests"))
SRC = os.environ.get("SRC", str(ROOT / "plugins/cuda/musegl_cuda/cpu/weight_kernels.c"))
def build(flags):
    h = hashlib.md5((open(SRC).read() + " ".join(flags)).encode()).hexdigest()[:10]
    out = f"/tmp/kernel_variants_{h}.so"
    if not os.path.exists(out):
        subprocess.check_call(["cc", "-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", *flags, SRC, "-o", out])
    lib = ctypes.CDLL(out)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.mw_matmul.argtypes = [i32, p, i64, i64, p, i64, i64, p, i64, i32]
    lib.mw_row_bytes.argtypes = [i32, i64]; lib.mw_row_bytes.restype = i64
    return lib
CODES = {"f16": 1, "q4_k": 12, "q5_k": 13, "q6_k": 14, "q8_0": 8}
def main():
    import torch
    from stored_weights_support import stored_weight
    dt = sys.argv[1]; n, k = map(int, sys.argv[2].split("x")); m = int(sys.argv[3]); threads = int(sys.argv[4])
    variants = [v.split() for v in sys.argv[5:]]
    libs = [build(v) for v in variants]
    st = stored_weight(dt, n, k)
    w = np.ascontiguousarray(st.data).view(np.uint8).reshape(n, -1).copy()
    x = np.random.default_rng(0).standard_normal((m, k)).astype(np.float32)
    ys = [np.zeros((m, n), np.float32) for _ in libs]
    times = [[] for _ in libs]
    for rep in range(11):
        for i, lib in enumerate(libs):
            t = time.thread_time() if threads == 1 else time.perf_counter()
            lib.mw_matmul(CODES[dt], w.ctypes.data, n, k, x.ctypes.data, k, m, ys[i].ctypes.data, n, threads)
            times[i].append((time.thread_time() if threads == 1 else time.perf_counter()) - t)
    for v, t, y in zip(variants, times, ys):
        same = np.array_equal(y, ys[0])
        print(f"{dt} {n}x{k} m{m} t{threads} [{' '.join(v)}]: {statistics.median(t[1:])*1e3:.2f} ms  min {min(t)*1e3:.2f}  same_as_first={same}", flush=True)
main()
