"""The body a decode graph captures, with taps, against the executor's eager step.

Run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported: ``test_graph_taps.py`` starts it in a subprocess). The
graphs' staging (:meth:`DecodeGraphs.stage_decode` for one row per sequence,
:meth:`DecodeGraphs.stage_plan` and :meth:`DecodeGraphs.stage_rows` for verify
blocks, the latter with drafts placed from the device) fills CPU tensors; the body
(:meth:`DecodeGraphs._run`, what ``capture`` records) then runs eagerly over
them. Its argmax ids and its static tap rows must match the CPU executor's
reference path for the same steps (float32).
"""

from __future__ import annotations

import torch

TAPS = (0, 2, 4)
NUM_BLOCKS = 12  # the executor's pool; block NUM_BLOCKS - 1 is the graphs' scratch block here


def check_tapped_graph_body() -> None:
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_core.tiny import default_model_path
    from musegl_cuda.executor import TorchExecutor
    from musegl_cuda.drafts import DraftRows
    from musegl_cuda.cuda.graphs import DecodeGraphs
    from musegl_cuda.cuda.plan import plan_step, rows_per_tile

    ex = TorchExecutor(load_checkpoint(default_model_path()), device="cpu", dtype="float32", weights="upcast")
    ex.allocate_kv(NUM_BLOCKS)
    scratch, pool = NUM_BLOCKS - 1, NUM_BLOCKS - 1
    c = ex.config
    bs = ex.block_size
    graphs = DecodeGraphs(ex.model, ex.kv, (4, 8), bs, 8, ex.decode_block_m, 1, TAPS)
    graphs.reset(scratch)
    tables = {0: [0, 1, 2], 1: [5, 3, 4]}
    prompts = {0: list(range(300, 321)), 1: list(range(900, 930))}
    ex.step(Step([SeqChunk(s, p, list(range(len(p))), tables[s]) for s, p in prompts.items()]))
    pos = {s: len(p) for s, p in prompts.items()}

    def compare(step: Step, width: int, staged) -> None:
        ids_ref = ex.step(Step(step.chunks, taps=TAPS))  # the reference path, same rows and cache
        with torch.inference_mode():
            staged()
            _, ids, hidden = graphs._run(width)
        assert hidden is not None and hidden.shape == (len(TAPS), width, c.hidden_size)
        row = 0
        for chunk in step.chunks:
            n = len(chunk.tokens)
            assert ids[row:row + n].tolist() == ids_ref.tokens[chunk.seq], chunk.seq
            diff = (hidden[:, row:row + n] - ids_ref.hidden[chunk.seq]).abs().max().item()
            assert diff <= 1e-4, (chunk.seq, diff)
            row += n

    # a decode step of one row per sequence (stage_decode), padded to width 4
    decode = Step([SeqChunk(s, [17 + s], [pos[s]], tables[s], sample=1) for s in (1, 0)], taps=TAPS, width=4)
    compare(decode, 4, lambda: graphs.stage_decode(decode.chunks, 4, pool, c.vocab_size))
    for s in pos:
        pos[s] += 1
    # verify blocks of 3 and 4 rows (stage_plan), padded to width 8
    verify = Step([SeqChunk(0, [5, 6, 7], list(range(pos[0], pos[0] + 3)), tables[0], sample=3),
                   SeqChunk(1, [8, 9, 10, 11], list(range(pos[1], pos[1] + 4)), tables[1], sample=4)],
                  taps=TAPS, width=8)
    plan = plan_step(verify, bs, pool, c.vocab_size, rows_per_tile(ex.decode_block_m, c.num_heads // c.num_kv_heads),
                     width=8, scratch_block=scratch, num_tiles=8)
    compare(verify, 8, lambda: graphs.stage_plan(plan))
    # the same blocks staged without a plan (stage_rows, the executor's path), their drafts
    # written into the graph's tokens on the device from a row of Step.drafts
    drafts = torch.tensor([[0, 0, 0], [9, 10, 11], [6, 7, 0]])
    placed = Step([SeqChunk(0, [5, 0, 0], verify.chunks[0].positions, tables[0], sample=3, draft_row=2),
                   SeqChunk(1, [8, 0, 0, 0], verify.chunks[1].positions, tables[1], sample=4, draft_row=1)],
                  taps=TAPS, width=8, drafts=drafts)

    def stage_rows() -> None:
        starts = graphs.stage_rows(placed.chunks, 8, pool, c.vocab_size,
                                   rows_per_tile(ex.decode_block_m, c.num_heads // c.num_kv_heads))
        DraftRows.of(placed, starts).place(graphs.tokens)

    compare(verify, 8, stage_rows)
    # graphs built without taps leave none
    plain = DecodeGraphs(ex.model, ex.kv, (4,), bs, 8, ex.decode_block_m, 1)
    plain.reset(scratch)
    with torch.inference_mode():
        assert plain._run(4)[2] is None
