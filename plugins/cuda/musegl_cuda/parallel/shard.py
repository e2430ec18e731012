"""Which part of each weight a tensor-parallel rank holds, and the decoder's collectives.

Megatron's split of a decoder layer, with the fused products kept fused:

* column-parallel (output rows split): q, k, v and the output gate (one stacked
  q/k/v/gate product per rank, as on one device), the MLP's gate and up (one
  stacked gate/up product);
* row-parallel (input columns split): o_proj and down_proj, each followed by an
  all-reduce of its partial sums (:meth:`TensorShard.reduce`);
* vocabulary-parallel: the embedding (each rank looks up the ids in its rows, the
  others give zeros, an all-reduce sums them) and the head (each rank's logits of
  its rows, gathered into the full row for the sampler, so every rank samples the
  same ids from the same numbers: :meth:`TensorShard.gather_vocab`; a draft's
  argmax over it gathers each rank's best instead: :meth:`TensorShard.argmax_vocab`).

Query heads are split evenly. KV heads are split where there are at least as
many as ranks; with fewer (2 KV heads, 4 or 8 ranks) each rank holds the one KV
head its query heads read (replicated over the ranks that share it). Norms, RoPE
and everything 1-D are whole on every rank.

A plan of size 1 is the identity: :class:`TensorShard` of one rank slices
nothing and its collectives return their input, so the decoder runs one code
path with or without tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.stored import StoredTensor


@attrs.frozen
class Span:
    """Indices ``start .. stop-1`` of one dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    def scaled(self, factor: int) -> "Span":
        """The span in units ``factor`` times smaller (heads -> rows of ``head_dim``)."""
        return Span(self.start * factor, self.stop * factor)


def check_size(config: TextConfig, size: int) -> None:
    """``ValueError`` (one line) when ``config`` cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return
    heads, kv, ffn = config.num_heads, config.num_kv_heads, config.intermediate_size
    if heads % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the {heads} attention heads")
    if kv % size and size % kv:
        raise ValueError(f"--tensor-parallel-size {size} and the {kv} KV heads: one must divide the other")
    if ffn % size:
        raise ValueError(f"--tensor-parallel-size {size} must divide the MLP width {ffn}")


@attrs.frozen
class ShardPlan:
    """Rank ``rank`` of ``size``: its query heads, KV heads, MLP columns and vocabulary rows.
    ``vocab_per_rank`` is every rank's padded share of the vocabulary (the last rank's
    real rows may be fewer; the gather pads to it), ``vocab_size`` the whole vocabulary."""

    size: int
    rank: int
    heads: Span
    kv_heads: Span
    ffn: Span
    vocab: Span
    vocab_per_rank: int
    vocab_size: int
    head_dim: int

    @classmethod
    def of(cls, config: TextConfig, size: int = 1, rank: int = 0) -> "ShardPlan":
        check_size(config, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside 0..{size - 1}")
        heads, kv, ffn, vocab = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
        per_heads, per_ffn = heads // size, ffn // size
        if kv >= size:
            per_kv = kv // size
            kv_span = Span(rank * per_kv, (rank + 1) * per_kv)
        else:  # fewer KV heads than ranks: the one KV head this rank's query heads read
            group = heads // kv
            first = rank * per_heads // group
            kv_span = Span(first, first + 1)
        per_vocab = -(-vocab // size)
        return cls(size, rank, Span(rank * per_heads, (rank + 1) * per_heads), kv_span,
                   Span(rank * per_ffn, (rank + 1) * per_ffn),
                   Span(min(vocab, rank * per_vocab), min(vocab, (rank + 1) * per_vocab)), per_vocab, vocab,
                   config.head_dim)

    def local_config(self, config: TextConfig) -> TextConfig:
        """``config`` as this rank's layers see it: its heads, KV heads and MLP width."""
        if self.size == 1:
            return config
        return attrs.evolve(config, num_heads=self.heads.size, num_kv_heads=self.kv_heads.size,
                            intermediate_size=self.ffn.size)

    def split(self, name: str) -> tuple[slice | None, slice | None]:
        """(rows, columns) of weight ``name`` (transformers names, ``(out, in)``) this rank
        holds; None: the whole dimension."""
        if self.size == 1:
            return None, None
        hd = self.head_dim
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return self.vocab.slice, None
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if suffix in ("self_attn.q_proj.weight", "self_attn.gate_proj.weight"):
            return self.heads.scaled(hd).slice, None
        if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            return self.kv_heads.scaled(hd).slice, None
        if suffix == "self_attn.o_proj.weight":
            return None, self.heads.scaled(hd).slice
        if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            return self.ffn.slice, None
        if suffix == "mlp.down_proj.weight":
            return None, self.ffn.slice
        return None, None  # norms

    def dense(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's part of a float weight (a view where the slice allows)."""
        rows, cols = self.split(name)
        if value.ndim < 2:
            return value
        if rows is not None:
            value = value[rows]
        if cols is not None:
            value = value[:, cols]
        return value

    def stored(self, stored: StoredTensor) -> StoredTensor:
        """This rank's part of a weight in its stored form. Rows of any type slice as they
        are; columns of a block-quantized type slice on block boundaries, and where the
        rank's columns cut a block the part is decoded to float32 first."""
        rows, cols = self.split(stored.name)
        if len(stored.shape) < 2 or (rows is None and cols is None):
            return stored
        if stored.scales is not None:  # FP8: its blocks of scales would need slicing too
            raise ValueError(f"{stored.name}: FP8 weights run without tensor parallelism")
        data = stored.data
        shape = list(stored.shape)
        if rows is not None:
            data = data[rows]
            shape[0] = rows.stop - rows.start
        if cols is not None:
            width = cols.stop - cols.start
            if not stored.quantized:
                data = data[:, cols]
            else:
                block = stored.block_size
                if cols.start % block or width % block:
                    part = StoredTensor(stored.name, stored.dtype, tuple(shape), data)
                    return StoredTensor(stored.name, "f32", (shape[0], width),
                                        np.ascontiguousarray(part.to_float32()[:, cols]))
                type_bytes = data.shape[1] // (shape[1] // block)
                data = data[:, cols.start // block * type_bytes:cols.stop // block * type_bytes]
            shape[1] = width
        return StoredTensor(stored.name, stored.dtype, tuple(shape), np.ascontiguousarray(data))


@attrs.define
class TensorShard:
    """A rank's :class:`ShardPlan` and the process group its device collectives run on
    (None for one rank: nothing to reduce or gather)."""

    plan: ShardPlan
    group: Any = None
    backend: str = "gloo"

    @classmethod
    def single(cls, config: TextConfig) -> "TensorShard":
        return cls(ShardPlan.of(config))

    @property
    def size(self) -> int:
        return self.plan.size

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``x`` (a row-parallel product's partial sums), in place."""
        if self.plan.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, z: torch.Tensor) -> torch.Tensor:
        """Every rank's columns of ``z (rows, local vocab)`` side by side: ``(rows, vocab)``."""
        plan = self.plan
        if plan.size == 1:
            return z
        import torch.distributed as dist

        per, rows = plan.vocab_per_rank, z.shape[0]
        if z.shape[1] < per:
            z = torch.nn.functional.pad(z, (0, per - z.shape[1]))
        z = z.contiguous()
        if self.backend == "nccl":
            out = torch.empty(plan.size, rows, per, dtype=z.dtype, device=z.device)
            dist.all_gather_into_tensor(out, z, group=self.group)
            full = out.permute(1, 0, 2).reshape(rows, plan.size * per)
        else:
            parts = [torch.empty_like(z) for _ in range(plan.size)]
            dist.all_gather(parts, z, group=self.group)
            full = torch.cat(parts, dim=1)
        return full[:, :plan.vocab_size]

    def argmax_vocab(self, z: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's argmax of ``z (rows, local vocab)`` without gathering the
        logits: each rank's best ``(value, global id)`` per row, an all-gather of those pairs,
        and the best of them (the lowest id among equal values, as ``argmax`` of the gathered
        row picks): ``(rows,)`` int64, the same on every rank."""
        plan = self.plan
        if plan.size == 1:
            return z.argmax(dim=-1)
        import torch.distributed as dist

        rows = z.shape[0]
        pair = torch.empty(rows, 2, dtype=torch.float64, device=z.device)
        if z.shape[1]:
            index = z.argmax(dim=-1)
            pair[:, 0] = z.gather(1, index[:, None])[:, 0]
            pair[:, 1] = index + plan.vocab.start  # below 2**53: exact in float64
        else:  # no real rows here (a tiny vocabulary over many ranks)
            pair[:, 0], pair[:, 1] = float("-inf"), 0
        if self.backend == "nccl":
            every = torch.empty(plan.size, rows, 2, dtype=pair.dtype, device=z.device)
            dist.all_gather_into_tensor(every, pair, group=self.group)
        else:
            parts = [torch.empty_like(pair) for _ in range(plan.size)]
            dist.all_gather(parts, pair, group=self.group)
            every = torch.stack(parts)
        best = every[:, :, 0].argmax(dim=0)  # the first rank with the highest value: the lowest id
        return every[:, :, 1].gather(0, best[None])[0].long()

    def embedding(self, lookup, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding rows of ``ids``: ``lookup(local ids)`` gives this
        rank's rows; ids outside them count zero; the all-reduce sums the ranks."""
        plan = self.plan
        if plan.size == 1:
            return lookup(ids)
        local = ids - plan.vocab.start
        inside = (local >= 0) & (local < plan.vocab.size)
        rows = lookup(torch.where(inside, local, torch.zeros_like(local)))
        rows = rows * inside.unsqueeze(-1).to(rows.dtype)
        return self.reduce(rows.contiguous())
