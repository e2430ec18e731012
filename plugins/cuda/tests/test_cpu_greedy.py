"""Greedy ids of softcapped logits without the full softcap (musegl_cuda.cpu.greedy) and the
CPU executor's plain-greedy steps that use it: the same ids as argmax of the full logits."""

from __future__ import annotations

import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda.cpu import greedy, native
from musegl_cuda.cpu.greedy import capped_argmax
from musegl_cuda.executor import TorchExecutor, single_threaded

CAP = 20.0


MULT = 0.19611613


def full_chain(z: torch.Tensor, multiplier: float = MULT, cap: float = CAP) -> torch.Tensor:
    """argmax of MuseGlimmerDecoder.logits' chain."""
    return torch.argmax(z.clone().mul_(multiplier).div_(cap).tanh_().mul_(cap), dim=-1)


@pytest.mark.parametrize("vocab", [37, 1000, 4099, 202048])
@pytest.mark.parametrize("spread", [0.05, 1.0, 30.0, 200.0])
def test_capped_argmax_gives_the_full_chains_ids(vocab, spread):
    g = torch.Generator().manual_seed(vocab + int(spread * 10))
    z = torch.randn(5, vocab, generator=g) * spread
    z[1, 7] = z[1, vocab - 1] = z[1].max()  # a tie: the first id wins
    z[2, -1] = z[2].max() + 1e-6 * spread  # the largest in the last (maybe partial) block
    top = z[3].max()
    z[3, 3:33] = top - torch.arange(30) * 1e-7 * spread  # near-ties that tanh may merge
    with single_threaded():
        got = capped_argmax(z, MULT, CAP)
        want = full_chain(z)
    if spread == 200.0:  # tanh saturates: too many candidates, or a bound past -1
        assert got is None or torch.equal(got, want)
    else:
        assert got is not None and torch.equal(got, want)


def test_capped_argmax_near_saturation_and_negative_logits():
    g = torch.Generator().manual_seed(3)
    for shift in (-300.0, -60.0, -5.0, 0.0, 5.0, 60.0, 100.0):
        z = torch.randn(3, 5000, generator=g) * 2 + shift
        with single_threaded():
            got = capped_argmax(z, 1.0, CAP)
            want = full_chain(z, 1.0)
        assert got is None or torch.equal(got, want), shift


def test_capped_argmax_declines_what_it_cannot_decide():
    z = torch.randn(2, 3000, generator=torch.Generator().manual_seed(4))
    with single_threaded():
        for bad in (float("nan"), float("inf")):
            v = z.clone()
            v[1, 5] = bad
            assert capped_argmax(v, MULT, CAP) is None
        assert capped_argmax(torch.full((1, 10000), 1000.0), MULT, CAP) is None  # every entry a candidate
        assert capped_argmax(z.t().contiguous().t(), MULT, CAP) is None  # not contiguous
        before = z.clone()
        assert capped_argmax(z, MULT, CAP) is not None and torch.equal(z, before)  # z unchanged
    if torch.get_num_threads() > 1:
        assert capped_argmax(z, MULT, CAP) is None  # the full chain of a wide step runs on several threads


def test_block_slices_take_the_full_arrays_tanh_bits():
    """What capped_argmax relies on: tanh of an aligned slice gives the bits tanh of the
    whole flattened array gives there (the last, partial block included)."""
    g = torch.Generator().manual_seed(6)
    for n in (202048, 202049, 1000 * 3 + 17):
        x = torch.randn(n, generator=g) * 3
        with single_threaded():
            whole = x.clone().tanh_()
            for start in range(0, n, greedy.BLOCK):
                assert torch.equal(x[start:start + greedy.BLOCK].clone().tanh_(), whole[start:start + greedy.BLOCK])


@pytest.mark.skipif(native.load() is None, reason="no stored-weight kernels")
def test_plain_greedy_steps_give_the_ids_of_the_full_logits(tmp_path):
    """Stored mode, decode steps of three sequences: the ids of plain-greedy steps (the
    capped path) are argmax of the logits the same steps return with ``want_logits``."""
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.testing.reference_models import build_tiny_model, tiny_tokenizer_data

    model = build_tiny_model(seed=5, hidden_size=128, intermediate_size=256, head_dim=32)
    model.save_pretrained(tmp_path / "hf")
    checkpoint = load_checkpoint(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(), file_type="q8_0")
    ex = TorchExecutor(load_checkpoint(path), device="cpu", block_size=16)
    assert ex.weights == "stored" and ex.config.final_logit_softcapping
    ex.allocate_kv(12)
    g = torch.Generator().manual_seed(8)
    tables = {s: list(range(4 * s, 4 * s + 4)) for s in range(3)}
    tokens = {s: torch.randint(0, 512, (20 + 5 * s,), generator=g).tolist() for s in range(3)}
    ex.step(Step([SeqChunk(seq=s, tokens=t, positions=list(range(len(t))), blocks=tables[s], sample=True)
                  for s, t in tokens.items()]))
    for _ in range(6):
        def chunks(want):
            return [SeqChunk(seq=s, tokens=[t[-1]], positions=[len(t) - 1 + 1], blocks=tables[s], sample=True,
                             want_logits=want) for s, t in tokens.items()]
        full = ex.step(Step(chunks(True)))  # the sampler over the full logits
        plain = ex.step(Step(chunks(False)))  # the same step again (same K/V writes): the capped path
        for s in tokens:
            assert plain.tokens[s] == full.tokens[s] == [int(torch.argmax(full.logits[s]))]
            tokens[s].append(plain.tokens[s][0])
