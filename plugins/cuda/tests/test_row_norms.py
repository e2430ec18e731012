"""The C row norms (musegl_cuda.cpu.row_norms): torch's bits, and a stored-mode executor that
uses them gives the bits of one that runs torch's ops."""

from __future__ import annotations

import pytest
import torch

from musegl_core import native as core_native
from musegl_core.checkpoint.gguf_writer import write_text_gguf
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_core.testing.reference_models import build_tiny_model, tiny_tokenizer_data
from musegl_cuda.cpu import native, row_norms
from musegl_cuda.executor import TorchExecutor

pytestmark = pytest.mark.skipif(core_native.compiler() is None, reason="no C compiler")


def centered(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("width", [32, 128, 1000, 1024, 2816, 5120, 40000])
def test_norms_give_torchs_bits(width):
    norms = row_norms.for_width(width)
    assert norms is not None  # this machine's torch: the sums agree (else the executor keeps torch's ops)
    g = torch.Generator().manual_seed(width)
    for rows, scale in ((1, 1.0), (5, 1e-2), (16, 1e2)):
        x = torch.randn(rows, width, generator=g) * scale
        o = torch.randn(rows, width, generator=g) * scale
        w = torch.randn(width, generator=g)
        assert torch.equal(norms.norm(x, w, 1e-6), centered(x, w, 1e-6))
        assert torch.equal(norms.norm(x, None, 1e-6), x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5))
        h, nxt = norms.add_norm(o, x, w, 1e-6, w.abs(), 1e-5)
        assert torch.equal(h, x + centered(o, w, 1e-6)) and torch.equal(nxt, centered(h, w.abs(), 1e-5))
        h2, none = norms.add_norm(o, x, w, 1e-6, None, 0.0)
        assert none is None and torch.equal(h2, h)


def test_norms_of_a_view_and_of_heads():
    norms = row_norms.for_width(64)
    x = torch.randn(3, 10 * 64)[:, :6 * 64].reshape(3, 6, 64)  # not contiguous
    assert torch.equal(norms.norm(x, None, 1e-6), x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5))


def test_a_disagreeing_width_keeps_torch(monkeypatch):
    monkeypatch.setattr(row_norms, "_widths", {})
    monkeypatch.setattr(row_norms, "LANES", (16,))  # not the width torch's sum kernel reads
    assert row_norms.for_width(1024) is None


@pytest.mark.skipif(native.load() is None, reason="no stored-weight kernels")
def test_stored_executor_with_c_norms_gives_torch_ops_bits(tmp_path):
    model = build_tiny_model(seed=5, hidden_size=128, intermediate_size=256, head_dim=32)
    model.save_pretrained(tmp_path / "hf")
    checkpoint = load_checkpoint(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(), file_type="q8_0")

    def run(c_norms: bool) -> list[torch.Tensor]:
        ex = TorchExecutor(load_checkpoint(path), device="cpu", block_size=16)
        assert ex.model.norms is not None and ex.model.layers[0].self_attn.head_norms is not None
        if not c_norms:
            ex.model.norms = None
            for layer in ex.model.layers:
                layer.norms = layer.self_attn.head_norms = None
        ex.allocate_kv(8)
        g = torch.Generator().manual_seed(2)
        prompts = {s: torch.randint(0, 512, (9 + 11 * s,), generator=g).tolist() for s in range(2)}
        out = ex.step(Step([SeqChunk(seq=s, tokens=t, positions=list(range(len(t))), blocks=[4 * s, 4 * s + 1],
                                     sample=True, want_logits=True) for s, t in prompts.items()]))
        logits = [out.logits[s] for s in range(2)]
        for i in range(4):
            out = ex.step(Step([SeqChunk(seq=s, tokens=[7 + i], positions=[len(t) + i], blocks=[4 * s, 4 * s + 1],
                                         sample=True, want_logits=True) for s, t in prompts.items()]))
            logits += [out.logits[s] for s in range(2)]
        return logits

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_qk_norm_rope_stores_k_and_v_as_index_copy_does():
    from musegl_cuda.model import apply_rope, plain_rms_norm

    norms = row_norms.for_width(32)
    g = torch.Generator().manual_seed(9)
    rows, heads, kvh = 3, 4, 2
    qkvg = torch.randn(rows, (2 * heads + 2 * kvh) * 32, generator=g)
    qk = qkvg[:, :(heads + kvh) * 32].reshape(rows, heads + kvh, 32)
    v = qkvg[:, (heads + kvh) * 32:(heads + 2 * kvh) * 32]
    cos, sin = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
    k_cache, v_cache = torch.zeros(20, kvh, 32), torch.zeros(20, kvh, 32)
    slots = torch.tensor([7, 0, 19])
    out = norms.qk_norm_rope(qk, heads, 1e-6, 0.5, (cos, sin), (k_cache, v_cache, slots, v))
    want = plain_rms_norm(qk, 1e-6)
    want[:, :heads].mul_(0.5)
    want = apply_rope(want, cos, sin)
    assert torch.equal(out, want)
    k_want, v_want = torch.zeros(20, kvh, 32), torch.zeros(20, kvh, 32)
    k_want.index_copy_(0, slots, want[:, heads:])
    v_want.index_copy_(0, slots, v.reshape(rows, kvh, 32))
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    before = k_cache.clone()
    assert norms.qk_norm_rope(qk, heads, 1e-6, 0.5, (cos, sin), (k_cache, v_cache, torch.tensor([1, 20, 2]), v)) is None
    assert torch.equal(k_cache, before)  # a slot outside the cache: nothing written
