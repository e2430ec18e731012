import sys, time, numpy as np, torch
sys.path.insert(0, "plugins/cuda/tests")
from pathlib import Path
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda.executor import TorchExecutor
from musegl_cuda.cuda.plan import plan_step, rows_per_tile
import tempfile
from gpu_checkpoint_support import write_gpu_checkpoint
path = write_gpu_checkpoint(Path(tempfile.mkdtemp()))
rng = np.random.default_rng(6)
prompts = [rng.integers(4, 4096, size=n).tolist() for n in (30, 64, 12, 40)][2:3]
feed = [[100, 200, 300]]
def paged_step(ex, step):
    c = ex.config
    block_m, split_tiles = ex._dynamic_attention(step)
    plan = plan_step(step, ex.block_size, ex.num_blocks, c.vocab_size, rows_per_tile(block_m, c.num_heads // c.num_kv_heads))
    with torch.inference_mode():
        normed, _ = ex._forward_plan(plan, ex.kv, block_m, split_tiles=split_tiles)
        last = [s + len(ch.tokens) - 1 for s, ch in zip(plan.starts, step.chunks)]
        return ex.model.logits(normed[last]).float()
def ref_step(ex, step):
    out = ex.step(Step([SeqChunk(ch.seq, ch.tokens, ch.positions, ch.blocks, want_logits=True) for ch in step.chunks]))
    return torch.stack([torch.as_tensor(out.logits[ch.seq]).float() for ch in step.chunks])
res = {}
for name, kv, fn in (("paged", "fp8", paged_step), ("ref", "fp8", ref_step), ("auto", "auto", ref_step)):
    ex = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32", kv_cache_dtype=kv)
    ex.allocate_kv(64); ex.sm_count = 132
    t = time.time()
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    out = [fn(ex, Step([SeqChunk(i, p, list(range(len(p))), tables[i]) for i, p in enumerate(prompts)]))]
    fed = [len(p) for p in prompts]
    for s in range(len(feed[0])):
        out.append(fn(ex, Step([SeqChunk(i, [feed[i][s]], [fed[i]], tables[i]) for i in range(len(prompts))])))
        fed = [f + 1 for f in fed]
    res[name] = out
    print(name, time.time() - t, [o.argmax(-1).tolist() for o in out], flush=True)
for a, b in (("paged", "ref"), ("ref", "auto")):
    print(a, b, [float((x - y).abs().max()) for x, y in zip(res[a], res[b])], flush=True)
