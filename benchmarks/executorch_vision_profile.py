"""The vision encoder alone, exported program vs the eager tower, same run.

Exports only ``vision_encoder`` of the tiny projector (``musegl make-tiny`` preset
"tiny", capacity 1024 patches) with one XNNPACK partitioner variant, then takes
the best of 5 CPU times of a 32 x 32-patch image through the program and through
the eager tower (one thread each) and prints one JSON line: export and lowering
seconds, both CPU times, the host's ``grid_inputs`` time and the largest difference.

    python benchmarks/executorch_vision_profile.py linear   # Linear + Tanh only
    python benchmarks/executorch_vision_profile.py bmm      # + BMM + Softmax
    python benchmarks/executorch_vision_profile.py all      # every op the partitioner takes (the export's choice)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def best_cpu(function, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        function()
        times.append(time.process_time() - started)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=("linear", "bmm", "all"))
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    import executorch.extension.pybindings.portable_lib as portable
    from executorch.backends.xnnpack.partition.config import BMMConfig, LinearConfig, SoftmaxConfig, TanhConfig
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.runtime import Runtime

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.checkpoint.vision import load_vision
    from musegl_core.tiny import make_tiny
    from musegl_cuda.vision import load_vision_encoder
    from musegl_executorch.export.lower import DATA_NAME, _export, vision_shapes, write
    from musegl_executorch.export.vision import ExportVisionEncoder, grid_inputs

    torch.set_num_threads(1)
    portable._unsafe_reset_threadpool(1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="musegl-vision-prof-"))
    gguf = make_tiny(work / "checkpoint", preset="tiny", file_type="f32", mmproj=True)
    checkpoint = load_checkpoint(gguf)
    vision = load_vision(gguf, gguf.parent / "mmproj.gguf", checkpoint.config.hidden_size)
    eager = load_vision_encoder(vision, checkpoint.config, torch.float32, torch.device("cpu"))
    module = ExportVisionEncoder(eager)
    configs = {"linear": [LinearConfig, TanhConfig], "bmm": [LinearConfig, TanhConfig, BMMConfig, SoftmaxConfig],
               "all": None}[args.variant]
    started = time.perf_counter()
    with torch.no_grad():
        exported = _export(module, *vision_shapes(module.config, 1024))
    export_s, started = time.perf_counter() - started, time.perf_counter()
    edge = to_edge_transform_and_lower({"vision_encoder": exported}, partitioner=[XnnpackPartitioner(configs=configs)],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    program = edge.to_executorch(ExecutorchBackendConfig(
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False), external_constants=lambda _n: DATA_NAME))
    lower_s = time.perf_counter() - started
    out = work / f"vision_{args.variant}"
    write(program, out)
    method = Runtime.get().load_program(out / "model.pte", data_path=out / "model.ptd").load_method("vision_encoder")
    grid = (32, 32)
    pixels = torch.from_numpy(np.random.default_rng(0).standard_normal((1024, 588)).astype(np.float32))
    inputs = [pixels, *grid_inputs(module.config, grid)]
    call = method._method  # without cloning the outputs, as the executor calls it
    with torch.no_grad():
        figures = {"variant": args.variant, "export_s": round(export_s, 2), "lower_s": round(lower_s, 2),
                   "eager_cpu_s": round(best_cpu(lambda: eager(pixels, grid)), 4),
                   "program_cpu_s": round(best_cpu(lambda: call(inputs, clone_outputs=False)), 4),
                   "grid_inputs_cpu_s": round(best_cpu(lambda: grid_inputs(module.config, grid)), 4),
                   "max_diff": float((eager(pixels, grid) - call(inputs, clone_outputs=False)[0]).abs().max())}
    figures["ratio"] = round(figures["program_cpu_s"] / figures["eager_cpu_s"], 3)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
