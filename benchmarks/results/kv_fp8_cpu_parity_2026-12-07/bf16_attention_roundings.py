import sys; sys.path.insert(0, "plugins/cuda/tests")
import torch
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda import kv_fp8
from musegl_cuda.cuda.plan import plan_step, rows_per_tile
bf = torch.bfloat16
def emulate(q, kf, vf, kscale, vscale, plan, bs, scale, gate, gate_offset, heads, hd, block_n=64):
    """one split, blocks of block_n keys, the kernel's roundings: p rounded to bf16 per block"""
    out = torch.zeros(q.shape[0], heads * hd)
    group = heads // kf.shape[1]
    for seq, row0, nrows, pos0 in plan.tiles.tolist():
        if nrows == 0: continue
        keys = torch.arange(0, pos0 + nrows)
        table = torch.as_tensor(plan.tables[seq], dtype=torch.long)
        slots = table[keys // bs] * bs + keys % bs
        k = kf[slots].repeat_interleave(group, 1).float(); v = vf[slots].repeat_interleave(group, 1).float()
        qq = q[row0:row0 + nrows].float()
        s = torch.einsum("lhd,shd->hls", qq, k) * (scale * kscale)
        qpos = torch.arange(pos0, pos0 + nrows)
        s = s.masked_fill(~(keys[None, :] <= qpos[:, None])[None], float("-inf"))
        m = torch.full(s.shape[:2], float("-inf")); l = torch.zeros(s.shape[:2]); acc = torch.zeros(s.shape[0], s.shape[1], hd)
        for j in range(0, len(keys), block_n):
            sb = s[:, :, j:j + block_n]
            mn = torch.maximum(m, sb.max(-1).values); ms = torch.where(mn == float("-inf"), 0.0, mn)
            a = torch.exp(m - ms); p = torch.exp(sb - ms[..., None])
            l = l * a + p.sum(-1)
            acc = acc * a[..., None] + torch.einsum("hls,shd->hld", p.to(bf).float(), v[j:j + block_n])
            m = mn
        acc = acc * vscale[:, None, None] if vscale.dim() else acc * vscale
        y = (acc / l[..., None]).to(bf).float()  # (heads, rows, hd)
        g = gate[row0:row0 + nrows, gate_offset:gate_offset + heads * hd].float().view(nrows, heads, hd).transpose(0, 1)
        res = (y * torch.sigmoid(g).to(bf).float()).to(bf).float()
        out[row0:row0 + nrows] = res.transpose(0, 1).reshape(nrows, -1)
    return out
torch.manual_seed(2)
heads, kvh, hd, bs, nb = 8, 2, 64, 16, 24
group = heads // kvh; gate_offset = heads * hd + 2 * kvh * hd
step = Step([SeqChunk(1, [3] * 10, list(range(30, 40)), list(range(0, 3))), SeqChunk(2, [4], [70], list(range(3, 8))),
             SeqChunk(3, [1] * 12, list(range(12)), list(range(10, 11)))])
k = torch.randn(nb + 1, bs, kvh, hd); v = torch.randn_like(k) * 3
scales = torch.stack([torch.full((kvh,), kv_fp8.k_scale(hd)), torch.linspace(0.02, 0.05, kvh)])
k8 = kv_fp8.quantize(k.view(-1, kvh, hd), scales[0]); v8 = kv_fp8.quantize(v.view(-1, kvh, hd), scales[1])
slots = torch.arange(k8.shape[0])
kd = kv_fp8.dequantize_rows(k8, slots, scales[0], bf); vd = kv_fp8.dequantize_rows(v8, slots, scales[1], bf)
worst = 0
for seed in range(20):
  for block_m in (16, 64):
    plan = plan_step(step, bs, nb, 100, rows_per_tile(block_m, group), scratch_block=nb)
    torch.manual_seed(100 + seed)
    q = torch.randn(plan.width, heads, hd).to(bf)
    gate = torch.randn(plan.width, 2 * heads * hd + 2 * kvh * hd).to(bf)
    vs_head = scales[1].repeat_interleave(group)
    y8 = emulate(q, k8.float(), v8.float(), scales[0][0], vs_head, plan, bs, hd ** -0.5, gate, gate_offset, heads, hd)
    yd = emulate(q, kd, vd, torch.tensor(1.0), torch.ones(heads), plan, bs, hd ** -0.5, gate, gate_offset, heads, hd)
    d = float((y8 - yd).abs().max()); mx = float(yd.abs().max())
    worst = max(worst, d / mx)
    if seed < 3: print(block_m, "diff", d, "max|y|", mx, "diff/max", d / mx, "2^-6*max", mx / 64)
print("worst diff/max over seeds", worst, "2^-7 =", 2**-7, "2^-6 =", 2**-6)
