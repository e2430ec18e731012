"""Steps for the executor tests, built as the engine builds them: a chunk with its
positions and position-keyed uniform numbers, and decode runs, plain or pipelined
(musegl_core only, so the GPU modules import it before they skip without torch)."""

from __future__ import annotations

from typing import Any

from musegl_core.engine.executor import GREEDY, SeqChunk, Step
from musegl_core.engine.randomness import uniform


def chunk(seq: int, tokens: list[int], start: int, blocks: list[int], **kw: Any) -> SeqChunk:
    """A chunk at positions ``start ..``; a sampled one gets its position-keyed uniform
    numbers, as the engine gives them."""
    positions = list(range(start, start + len(tokens)))
    params = kw.get("sampling", GREEDY)
    if kw.get("sample") and "uniforms" not in kw:
        n = int(kw["sample"])
        kw["uniforms"] = [uniform(params.seed or 0, p + 1) for p in positions[len(positions) - n:]]
    return SeqChunk(seq=seq, tokens=tokens, positions=positions, blocks=blocks, **kw)


def decode_run(ex: Any, prompts: dict[int, list[int]], blocks: dict[int, list[int]],
               settings: dict[int, dict[str, Any]], steps: int, pipelined: bool,
               width: int = 0) -> dict[int, list[int]]:
    """Prefill each sequence's prompt (a step each, its last row sampled), then ``steps``
    decode steps of one row per sequence (``width`` rows run); the ids each sequence got.
    ``pipelined``: each step is launched before the previous one is read, its chunks
    following that step's ids (their token is then a placeholder). ``settings[seq]`` are
    the sequence's chunk keywords (its ``sampling``)."""
    ids: dict[int, list[int]] = {}
    fed: dict[int, int] = {}
    for s, tokens in prompts.items():
        out = ex.step(Step([chunk(s, tokens, 0, blocks[s], sample=1, **settings[s])]))
        ids[s], fed[s] = list(out.tokens[s]), len(tokens)

    def collect(out) -> None:
        for s in prompts:
            ids[s] += out.tokens[s]

    pending = None
    for i in range(steps):
        follows = pipelined and pending is not None
        chunks = [chunk(s, [ids[s][-1]], fed[s] + i, blocks[s], sample=1, follows=follows, **settings[s])
                  for s in prompts]
        launched = ex.launch(Step(chunks, width=width))
        if pipelined:
            if pending is not None:
                collect(pending.result())
            pending = launched
        else:
            collect(launched.result())
    if pending is not None:
        collect(pending.result())
    return ids


def greedy_ids(ex: Any, prompt: list[int], steps: int, seq: int = 1, blocks: list[int] | None = None) -> list[int]:
    """Prefill ``prompt`` (its last row sampled), then ``steps`` one-row greedy decode steps
    fed the previous id: the ``steps + 1`` ids sampled (the GPU tests' greedy helper, also
    run on the CPU by ``test_decode_helpers.py`` so that it follows the step API there)."""
    blocks = list(range(16, 32)) if blocks is None else blocks
    out = ex.step(Step([chunk(seq, list(prompt), 0, blocks, sample=1)]))
    ids = [int(t) for t in out.tokens[seq]]
    for i in range(steps):
        out = ex.step(Step([chunk(seq, [ids[-1]], len(prompt) + i, blocks, sample=1)]))
        ids += [int(t) for t in out.tokens[seq]]
    return ids
