"""Long prefill chunks' global layers through torch's fused attention (musegl_cuda.cuda.dense_attention).

The CUDA backends (cuDNN, FlashAttention) need a GPU; on the CPU the same function runs through
SDPA's math backend, which checks the gather of the keys from out-of-order pages, the bottom-right
causal alignment of a chunk that follows cached keys, GQA and the gate against a plain loop.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend

from musegl_cuda.cuda import dense_attention
from musegl_cuda.cuda.dense_attention import DenseKeys, available, bucket, dense_gated_attention

HEADS, KV_HEADS, HD, BS = 4, 2, 8, 4


def paged(keys: int, seed: int = 0):
    """A cache of ``keys`` keys in pages handed out out of order, and the table row."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-keys // BS)
    pool = blocks + 3  # pages nobody's table names, holding garbage
    k = torch.randn(pool * BS, KV_HEADS, HD, generator=g)
    v = torch.randn(pool * BS, KV_HEADS, HD, generator=g)
    table = torch.randperm(pool, generator=g)[:blocks].to(torch.int32)
    return k, v, table


def reference(q, k, v, table, keys, gate, scale):
    """The loop: row i is position keys - rows + i and attends keys 0 .. its position."""
    rows = q.shape[0]
    slot = [int(table[p // BS]) * BS + p % BS for p in range(keys)]
    out = torch.empty(rows, HEADS, HD)
    for i in range(rows):
        pos = keys - rows + i
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            kk = torch.stack([k[s, kv] for s in slot[:pos + 1]])
            vv = torch.stack([v[s, kv] for s in slot[:pos + 1]])
            w = torch.softmax(kk @ q[i, h] * scale, dim=0)
            out[i, h] = (w[:, None] * vv).sum(0) * torch.sigmoid(gate[i, h])
    return out.reshape(rows, HEADS * HD)


@pytest.mark.parametrize("rows,keys", [(9, 9), (6, 23), (1, 5)])
def test_matches_the_loop(rows, keys):
    k, v, table = paged(keys)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(rows, HEADS, HD, generator=g)
    offset = 3  # the gate sits inside a wider qkvg row, as in the model
    qkvg = torch.randn(rows, offset + HEADS * HD + 5, generator=g)
    gate = qkvg[:, offset:offset + HEADS * HD].view(rows, HEADS, HD)
    dense = DenseKeys.of_table(table, BS, rows, keys)
    assert dense.slots.tolist() == [int(table[p // BS]) * BS + p % BS for p in range(keys)]
    got = dense_gated_attention(q, k, v, dense, 1 / math.sqrt(HD), qkvg, offset, backends=[SDPBackend.MATH])
    torch.testing.assert_close(got, reference(q, k, v, table, keys, gate, 1 / math.sqrt(HD)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bucket_rows", [1, 4, 16])
def test_a_sequence_starting_chunk_padded_to_its_bucket_keeps_its_rows(monkeypatch, bucket_rows):
    """cuDNN sees the chunk at a bucketed length (one plan per bucket, not per length): the
    padding rows come after the real ones, so the real rows' outputs are the loop's."""
    monkeypatch.setattr(dense_attention, "BUCKET_ROWS", bucket_rows)
    rows = 9
    k, v, table = paged(rows)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(rows, HEADS, HD, generator=g)
    qkvg = torch.randn(rows, HEADS * HD, generator=g)
    got = dense_gated_attention(q, k, v, DenseKeys.of_table(table, BS, rows, rows), 0.3, qkvg, 0,
                                backends=[SDPBackend.MATH])
    assert got.shape == (rows, HEADS * HD)
    torch.testing.assert_close(got, reference(q, k, v, table, rows, qkvg.view(rows, HEADS, HD), 0.3),
                               rtol=1e-5, atol=1e-5)


def test_buckets():
    assert [bucket(n) for n in (1, 1023, 1024, 1025, 2048, 2049)] == [1024, 1024, 1024, 2048, 2048, 3072]


def test_rows_must_be_the_chunk():
    k, v, table = paged(8)
    q = torch.randn(3, HEADS, HD)
    with pytest.raises(ValueError, match="3 query rows for a chunk of 4"):
        dense_gated_attention(q, k, v, DenseKeys.of_table(table, BS, 4, 8), 1.0, torch.zeros(3, HEADS * HD), 0,
                              backends=[SDPBackend.MATH])


def test_not_available_off_cuda_or_in_float32():
    assert not available(torch.device("cpu"), torch.bfloat16, HEADS, KV_HEADS, HD)
    assert not available(torch.device("cuda"), torch.float32, HEADS, KV_HEADS, HD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_executor_long_chunks_match_the_paged_kernel(tmp_path):
    """bf16 on the GPU: a 1,536-token prompt (cuDNN, padded to 2,048 rows) then a 1,100-token
    chunk after it (FlashAttention) give the logits of the paged kernel in every layer, and
    the same greedy token."""
    from gpu_checkpoint_support import write_gpu_checkpoint

    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cuda import dense_attention
    from musegl_cuda.executor import TorchExecutor

    path = write_gpu_checkpoint(tmp_path)
    rng = torch.Generator().manual_seed(3)
    first = torch.randint(4, 4096, (1536,), generator=rng).tolist()
    second = torch.randint(4, 4096, (1100,), generator=rng).tolist()
    blocks = list(range(-(-(len(first) + len(second)) // 16)))
    results = {}
    for dense in (False, True):
        executor = TorchExecutor(load_checkpoint(path), device="cuda", dtype="bfloat16")
        assert executor.dense_prefill, "cuDNN and FlashAttention should both run on this GPU"
        executor.dense_prefill = dense
        executor.allocate_kv(len(blocks) + 4)
        out = []
        for start, tokens in ((0, first), (len(first), second)):
            step = Step([SeqChunk(0, tokens, list(range(start, start + len(tokens))), blocks, logit_rows=True)])
            out.append(executor.step(step).logits[0].float().cpu())
        executor.close()
        results[dense] = out
    assert len(first) >= dense_attention.MIN_ROWS and len(second) >= dense_attention.MIN_ROWS
    for paged_logits, dense_logits in zip(results[False], results[True]):
        assert (paged_logits - dense_logits).abs().max().item() <= 0.25
        assert torch.equal(paged_logits[-1].argmax(), dense_logits[-1].argmax())
