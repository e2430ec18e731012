import subprocess, sys, threading, time, os
sys.path.insert(0, "/work/wt/stepcost/benchmarks")
from common import serve_process
from musegl_core.bench import BenchConfig, run_bench
M = "/root/.cache/musegl/tiny-e212cbaa4af7b0c4/model-q4_k_m.gguf"
flags = ("--max-decode-sequences", "4", "--max-inflight-requests", "4", "--max-sessions", "4", "--max-context", "2048")
with serve_process(M, *flags) as (url, proc):
    run_bench(BenchConfig(url=url, workload="chat", concurrency=1, requests=1, max_tokens=16, prompt_tokens=256, seed=1), progress=False)
    kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    print("front", proc.pid, "children", kids, flush=True)
    t = threading.Thread(target=lambda: run_bench(BenchConfig(url=url, workload="chat", concurrency=1, requests=3, max_tokens=200, prompt_tokens=256, seed=0), progress=False))
    t.start()
    time.sleep(3)
    procs = []
    for pid, name in [(kids[-1], "worker"), (str(proc.pid), "front")]:
        procs.append(subprocess.Popen(["py-spy", "record", "--pid", pid, "--duration", "6", "--rate", "250", "--format", "raw", "--threads",
                                       "-o", f"/tmp/spy_{name}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    for p in procs: p.wait()
    t.join()
