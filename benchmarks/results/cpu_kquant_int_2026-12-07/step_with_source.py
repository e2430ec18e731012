"""benchmarks/cpu_step_cputime.py with the kernels built from another source ($KSRC, e.g. the file at
the base commit; empty: this checkout's)."""
import os
import runpy
import sys
from pathlib import Path

import musegl_cuda.cpu.native as n

BENCH = Path(__file__).resolve().parents[2]
if os.environ.get("KSRC"):
    n.SOURCE = Path(os.environ["KSRC"])
sys.path.insert(0, str(BENCH))
sys.argv = ["cpu_step_cputime.py"] + sys.argv[1:]
runpy.run_path(str(BENCH / "cpu_step_cputime.py"), run_name="__main__")
