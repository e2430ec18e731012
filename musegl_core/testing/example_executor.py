"""A small executor written from docs/executor.md alone: a toy "model" in numpy.

It is the example the executor docs point to, and tests use it to watch the
engine from the executor's side (step widths, block tables, embedding rows,
sampled rows). The "model" is a hash: the logits after position ``p`` depend
on every token (or embedding row) at positions ``0..p``, read back through
the block table from the "KV cache" (one context hash per cache cell), so a
wrong block table, a missed copy-on-write or a wrong reused prefix changes
the output.

It implements greedy and seeded sampling with temperature and top-k, the
allowed-token masks, log-probabilities and logits (``want_logits``,
``logit_rows``); other sampling parameters are refused with ValueError (an
executor must never silently ignore one). It passes the conformance suite
(:mod:`musegl_core.testing.conformance`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from musegl_core.engine.executor import ExecutorLimits, ModelInfo, PromptImage, Step, StepOutput
from musegl_core.engine.sample_rows import unpack_mask
from musegl_core.engine.step_checks import check_step
from musegl_core.testing.reference_sampler import RowContext, row_logprobs


def _mix(*values: int) -> int:
    digest = hashlib.blake2b(b"".join(int(v).to_bytes(8, "little", signed=True) for v in values), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


class ExampleExecutor:
    """The whole contract: info, block_size, limits and eight methods."""

    block_size = 4

    def __init__(self, vocab_size: int, step_sizes: tuple[int, ...] = (), hidden_size: int = 8):
        self.info = ModelInfo(name="example", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=1,
                              native_context=1 << 16, dtype="float32", backend="example", vision=True)
        self.limits = ExecutorLimits(max_step_tokens=4096, step_sizes=step_sizes)
        self.cells: np.ndarray | None = None  # (blocks * block_size,) context hash per cache cell
        self.steps: list[Step] = []  # every step seen (tests read widths and chunks from here)
        self.images_encoded = 0

    # -- memory ------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.block_size * 8

    def kv_memory_available(self) -> int | None:
        return None  # no bound known: the pool is sized from the limits

    def allocate_kv(self, num_blocks: int) -> None:
        self.cells = np.zeros(num_blocks * self.block_size, dtype=np.int64)

    def copy_blocks(self, pairs) -> None:
        b = self.block_size
        for src, dst in pairs:
            self.cells[dst * b:(dst + 1) * b] = self.cells[src * b:(src + 1) * b]

    # -- images ------------------------------------------------------------------------
    def embed_image(self, image: PromptImage):
        self.images_encoded += 1
        pixels = np.asarray(image.pixels, dtype=np.float32).reshape(image.rows, -1)
        return pixels[:, :1].repeat(self.info.hidden_size, axis=1)

    # -- the forward -------------------------------------------------------------------
    def _logits(self, context: int) -> np.ndarray:
        rng = np.random.default_rng(context & 0x7FFFFFFFFFFFFFFF)
        return rng.standard_normal(self.info.vocab_size).astype(np.float32) * 3.0

    def _sample(self, logits: np.ndarray, chunk, j: int) -> int:
        params = chunk.sampling
        if params.top_p < 1 or params.min_p > 0 or params.logit_bias or params.penalized:
            raise ValueError("the example executor implements temperature, top_k and masks only")
        z = logits.astype(np.float64)
        if j < len(chunk.masks) and chunk.masks[j] is not None:
            z = np.where(unpack_mask(chunk.masks[j], len(z)), z, -np.inf)
        if params.greedy:
            return int(np.argmax(z))
        z = z / params.temperature
        if 0 < params.top_k < len(z):
            z = np.where(z >= np.sort(z)[-params.top_k], z, -np.inf)
        p = np.exp(z - z.max())
        cdf = np.cumsum(p)
        return int(min(np.searchsorted(cdf, chunk.uniforms[j] * cdf[-1], side="right"), len(z) - 1))

    def step(self, step: Step) -> StepOutput:
        self.steps.append(step)
        out = StepOutput()
        b = self.block_size
        check_step(step, b, len(self.cells) // b, self.info.vocab_size)
        for chunk in step.chunks:
            inputs = list(chunk.tokens)
            for span in chunk.embeds:  # embedding rows replace their placeholder ids
                rows = np.asarray(span.embedding)[span.first:span.first + span.count]
                for k in range(span.count):
                    inputs[span.offset + k] = 1_000_000 + int(rows[k, 0] * 1000)
            first = chunk.positions[0]
            previous = 0 if first == 0 else int(self.cells[chunk.blocks[(first - 1) // b] * b + (first - 1) % b])
            sampled, logprobs, rows = [], [], []
            last = len(inputs) - 1
            for r, (position, value) in enumerate(zip(chunk.positions, inputs)):
                context = _mix(previous, value, position)
                self.cells[chunk.blocks[position // b] * b + position % b] = context
                previous = context
                if not (chunk.logit_rows or r in chunk.sampled_rows or (chunk.want_logits and r == last)):
                    continue  # nobody reads this row's logits (a prompt row): only its cache cell
                logits = self._logits(context)
                rows.append(logits)
                if r in chunk.sampled_rows:
                    j = r - chunk.sampled_rows.start
                    token = self._sample(logits, chunk, j)
                    sampled.append(token)
                    if chunk.logprobs >= 0:
                        mask = chunk.masks[j] if j < len(chunk.masks) else None
                        logprobs.append(row_logprobs(logits, chunk.sampling, token, chunk.logprobs,
                                                     RowContext(mask=mask)))
            if chunk.sample:
                out.tokens[chunk.seq] = sampled
                if chunk.logprobs >= 0:
                    out.logprobs[chunk.seq] = logprobs
            if chunk.logit_rows:
                out.logits[chunk.seq] = np.stack(rows)
            elif chunk.want_logits:
                out.logits[chunk.seq] = rows[-1]
        return out

    def release_sequence(self, seq: int) -> None:
        pass

    def close(self) -> None:
        self.cells = None
