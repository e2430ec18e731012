"""Per-sequence sampling on the executor's device.

Each sequence handle owns one ``torch.Generator`` seeded from
``SamplingParams.seed`` (or from OS randomness when the seed is None). A
sequence's draws therefore depend only on its own logits and its own
generator, never on which other sequences share the step.
"""

from __future__ import annotations

import os

import torch

from musegl_core.engine.executor import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of float32 logits.

    Removed entries become ``-inf``. top-k keeps the ``k`` largest values;
    top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches ``top_p`` (always at least the most likely token).
    """
    z = logits / params.temperature
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


class Sampler:
    """Draws one token per chunk, with one random generator per sequence."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def generator(self, seq: int, seed: int | None) -> torch.Generator:
        """The sequence's generator, created (and seeded) on first use."""
        gen = self._generators.get(seq)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
            self._generators[seq] = gen
        return gen

    def sample(self, seq: int, logits: torch.Tensor, params: SamplingParams) -> int:
        """One token id from a row of float32 logits.

        Greedy (temperature 0) and ``top_k == 1`` take the argmax, lowest
        index on ties; they do not consume the generator.
        """
        if params.greedy or params.top_k == 1:
            return int(torch.argmax(logits))
        probs = torch.softmax(filter_logits(logits, params), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator(seq, params.seed)))

    def release(self, seq: int) -> None:
        self._generators.pop(seq, None)

    def __len__(self) -> int:
        return len(self._generators)
