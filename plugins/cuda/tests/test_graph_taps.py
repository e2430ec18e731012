"""Tapped decode and verify steps in the CUDA graphs, without a GPU.

The graph body with taps runs in Triton's interpreter against the executor's
eager step (``graph_tap_checks.py``, in a subprocess because
``TRITON_INTERPRET`` must be set before Triton is imported); the packing of a
graph step's tap rows per chunk is checked against the packing of the
sampler's path (:meth:`HeadRows.output`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from musegl_core.engine.executor import HeadRows, SeqChunk, Step
from musegl_cuda.cuda.graphs import DecodeGraphs
from musegl_cuda.pending import GreedyIds


@pytest.mark.slow  # Triton's interpreter (~14 s in the default suite on two shared cores); CI runs the slow tier as its second step
def test_tapped_graph_body_matches_the_eager_step_in_the_interpreter():
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    code = (f"import os, sys; sys.path.insert(0, {str(here)!r}); "
            "from graph_tap_checks import check_tapped_graph_body; check_tapped_graph_body(); "
            "print('checked', flush=True); os._exit(0)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-4000:]


def test_a_graph_step_packs_its_tap_rows_per_chunk_like_the_sampler_path():
    step = Step([SeqChunk(4, [1, 2, 3], [7, 8, 9], [0, 1, 2], sample=3),
                 SeqChunk(9, [5], [3], [3], sample=1),
                 SeqChunk(2, [6, 7], [10, 11], [4, 5, 6], sample=2)], taps=(1, 3), width=8)
    starts = [0, 3, 4]
    hidden = torch.randn(2, 6, 5)
    ids = torch.arange(100, 108)
    got = GreedyIds(step.chunks, (ids, None), None, starts, hidden).result()
    want = HeadRows.of(step, starts).output(step, starts, None, ids[:6].tolist(), [], hidden)
    assert got.tokens == want.tokens
    assert got.hidden.keys() == want.hidden.keys()
    for seq in want.hidden:
        assert torch.equal(got.hidden[seq], want.hidden[seq])
    # one row per sequence (stage_decode's layout): row i is chunk i
    decode = [SeqChunk(s, [1], [5], [0], sample=1) for s in (3, 1)]
    one = GreedyIds(decode, (ids, None), {3: 0, 1: 1}, hidden=hidden[:, :2]).result()
    assert one.tokens == {3: [100], 1: [101]}
    assert torch.equal(one.hidden[1], hidden[:, 1:2])
    assert GreedyIds(decode, (ids, None), None).result().hidden == {}


def test_graphs_serve_their_own_taps_or_none():
    graphs = DecodeGraphs(None, torch.zeros(1), (4,), 4, 8, 16, 1, (0, 2))
    assert graphs.serves_taps(()) and graphs.serves_taps((0, 2))
    assert not graphs.serves_taps((0,)) and not graphs.serves_taps((2, 0))
    assert DecodeGraphs(None, torch.zeros(1), (4,), 4, 8, 16, 1).serves_taps(())
    assert not DecodeGraphs(None, torch.zeros(1), (4,), 4, 8, 16, 1).serves_taps((1,))
