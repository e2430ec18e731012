"""cpu_step_cputime.py with the kernels built from another source ($KSRC, e.g. the file at the base commit)."""
import sys, os
from pathlib import Path
src = os.environ.get("KSRC")
import musegl_cuda.cpu.native as n
if src:
    n.SOURCE = Path(src)
sys.path.insert(0, "/work/wt/avx2/benchmarks")
sys.argv = ["cpu_step_cputime.py"] + sys.argv[1:]
import runpy
runpy.run_path("/work/wt/avx2/benchmarks/cpu_step_cputime.py", run_name="__main__")
