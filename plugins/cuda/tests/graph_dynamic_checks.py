"""A decode graph's body against the dynamic path for the same verify-shaped step, FP8 KV.

Run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported: ``test_graph_dynamic_parity.py`` starts it in a subprocess). The graphs' staging
(:meth:`DecodeGraphs.stage_rows`, the executor's path for verify blocks) fills CPU tensors and
the body (:meth:`DecodeGraphs._run`, what ``capture`` records) runs eagerly; the dynamic path
is what ``TorchExecutor`` runs for the same step without graphs (``_dynamic_attention`` then
``_forward_plan``). Both must launch the attention kernel alike (tile size, key splits) and give
the same logits bit for bit: on an H100 they once split the keys differently and greedy ids
parted in bf16 (benchmarks/results/gpu_quantized_2026-12-07_h100). The multiprocessor count is
an H100's (132), so that the splits are the ones a GPU launches.
"""

from __future__ import annotations

import torch

NUM_BLOCKS = 16  # the executor's pool; block NUM_BLOCKS - 1 is the graphs' scratch block here
SM_COUNT = 132


def check_verify_step_graph_vs_dynamic(rows: int = 2) -> None:
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_core.tiny import default_model_path
    from musegl_cuda.cuda import kernels
    from musegl_cuda.cuda.graphs import DecodeGraphs
    from musegl_cuda.cuda.plan import plan_step, rows_per_tile
    from musegl_cuda.executor import TorchExecutor

    ex = TorchExecutor(load_checkpoint(default_model_path()), device="cpu", dtype="float32", weights="upcast",
                       kv_cache_dtype="fp8")
    ex.allocate_kv(NUM_BLOCKS)
    ex.sm_count = SM_COUNT
    c, bs = ex.config, ex.block_size
    scratch = pool = NUM_BLOCKS - 1
    tables = {s: [3 * s, 3 * s + 1, 3 * s + 2] for s in range(4)}
    prompts = {s: list(range(100 + 40 * s, 100 + 40 * s + n)) for s, n in enumerate((9, 21, 14, 5))}
    ex.step(Step([SeqChunk(s, p, list(range(len(p))), tables[s]) for s, p in prompts.items()]))
    width = rows * len(prompts)  # a captured width, no padding rows (the GPU test's shape)
    step = Step([SeqChunk(s, [7 + s] * rows, list(range(len(p), len(p) + rows)), tables[s], sample=rows)
                 for s, p in prompts.items()], width=width)
    graphs = DecodeGraphs(ex.model, ex.kv, (width,), bs, 8, ex.decode_block_m, SM_COUNT)
    graphs.reset(scratch)
    cache = ex.kv.clone()

    launches: list[tuple[int, int]] = []
    real = kernels.gated_attention

    def recorded(q, k, v, kv_block, tables, tiles, num_tiles, splits, block_m, *args, **kw):
        launches.append((block_m, splits))
        return real(q, k, v, kv_block, tables, tiles, num_tiles, splits, block_m, *args, **kw)

    kernels.gated_attention = recorded
    try:
        with torch.inference_mode():
            graphs.stage_rows(step.chunks, width, pool, c.vocab_size,
                              rows_per_tile(ex.decode_block_m, c.num_heads // c.num_kv_heads))
            graph_logits = graphs._run(width)[0].clone()
            graph_launches, launches[:] = list(launches), []
            ex.kv.copy_(cache)  # the same cache before the step, for the dynamic path
            block_m, split_tiles = ex._dynamic_attention(step)
            plan = plan_step(step, bs, pool, c.vocab_size, rows_per_tile(block_m, c.num_heads // c.num_kv_heads))
            normed, _ = ex._forward_plan(plan, ex.kv, block_m, split_tiles=split_tiles)
            dynamic_logits = ex.model.logits(normed)
    finally:
        kernels.gated_attention = real
    assert len(graph_launches) == c.num_layers and graph_launches == launches, (graph_launches, launches)
    assert any(splits > 1 for _, splits in launches)  # the merged splits run too
    assert torch.equal(graph_logits[:width], dynamic_logits), (graph_logits[:width] - dynamic_logits).abs().max()
