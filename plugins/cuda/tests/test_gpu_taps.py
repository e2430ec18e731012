"""Tapped and device-draft steps through the CUDA graphs (marked ``gpu``: run with ``-m gpu``).

With the speculator's taps captured (:meth:`TorchExecutor.expect_taps`),
decode steps (one row per sequence) and verify blocks replay their graph,
and their sampled ids and tapped rows match the same steps run eagerly
(``forward_sizes=()``, the same kernels outside any graph), float32. A
verify step whose drafts stay on the device (``SeqChunk.draft_row``) samples
what the same step with the drafts inline samples, and its accepted counts
are ``accept``'s, through the graph and eagerly.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_checkpoint_support import write_gpu_checkpoint

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TAPS = (1, 4, 8)


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    return write_gpu_checkpoint(tmp_path_factory.mktemp("gpu_taps"))


def executor(path, graphs: bool):
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_cuda.executor import TorchExecutor

    ex = TorchExecutor(load_checkpoint(path), device="cuda", dtype="float32", forward_sizes=None if graphs else ())
    ex.expect_taps(TAPS)
    ex.allocate_kv(80)
    replays = []
    if ex.graphs is not None:
        replay = ex.graphs.replay
        ex.graphs.replay = lambda width: (replays.append(width), replay(width))
    return ex, replays


def test_tapped_decode_and_verify_steps_replay_graphs_and_match_the_eager_path(checkpoint_path):
    from musegl_core.engine.executor import SeqChunk, Step

    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 4096, size=n).tolist() for n in (19, 33, 50)]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(3)]
    forced = rng.integers(4, 4096, size=(3, 24)).tolist()
    results = {}
    for graphs in (True, False):
        ex, replays = executor(checkpoint_path, graphs)
        out = ex.step(Step([SeqChunk(i, p, list(range(len(p))), tables[i], sample=1) for i, p in enumerate(prompts)],
                           taps=TAPS))
        got = [(out.tokens, {s: h.cpu() for s, h in out.hidden.items()})]
        pos = [len(p) for p in prompts]
        for s in range(6):
            if s % 2 == 0:  # one row per sequence (stage_decode), width 4
                chunks = [SeqChunk(i, [forced[i][s]], [pos[i]], tables[i], sample=1) for i in range(3)]
            else:  # verify blocks of 4, 2 and 3 rows (stage_plan), width 16
                chunks = [SeqChunk(i, forced[i][s:s + k], list(range(pos[i], pos[i] + k)), tables[i], sample=k)
                          for i, k in zip(range(3), (4, 2, 3))]
            step = Step(chunks, taps=TAPS, width=4 if s % 2 == 0 else 16)
            out = ex.step(step)
            got.append((out.tokens, {seq: h.cpu() for seq, h in out.hidden.items()}))
            if s % 2 == 0:  # a decode row stays; verify rows are rewritten by the next step
                pos = [p + 1 for p in pos]
        results[graphs] = got
        if graphs:
            assert replays == [4, 16, 4, 16, 4, 16]
        ex.close()
    for (tokens_g, hidden_g), (tokens_e, hidden_e) in zip(results[True], results[False]):
        assert tokens_g == tokens_e
        for seq in hidden_e:
            assert hidden_g[seq].shape == hidden_e[seq].shape
            assert (hidden_g[seq] - hidden_e[seq]).abs().max().item() <= 1e-4


def test_device_drafts_through_a_graph_count_the_accepted_like_accept(checkpoint_path):
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_core.engine.speculator import accept

    rng = np.random.default_rng(8)
    prompts = [rng.integers(4, 4096, size=n).tolist() for n in (21, 40)]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(2)]
    for graphs in (True, False):
        answers = {}
        for on_device in (False, True):
            ex, replays = executor(checkpoint_path, graphs)
            first = ex.step(Step([SeqChunk(i, p, list(range(len(p))), tables[i], sample=1)
                                  for i, p in enumerate(prompts)]))
            cont = {i: list(first.tokens[i]) for i in range(2)}
            for k in range(4):  # the greedy continuation
                out = ex.step(Step([SeqChunk(i, [cont[i][-1]], [len(prompts[i]) + k], tables[i], sample=1)
                                    for i in range(2)], width=2))
                for i in range(2):
                    cont[i] += out.tokens[i]
            proposed = {0: cont[0][1:5], 1: [cont[1][1], (cont[1][2] + 1) % 4096, cont[1][3], cont[1][4]]}
            drafts = torch.tensor([proposed[1], proposed[0]], device="cuda")
            row = {0: 1, 1: 0}
            chunks = [SeqChunk(i, [cont[i][0]] + ([0] * 4 if on_device else proposed[i]),
                               list(range(len(prompts[i]), len(prompts[i]) + 5)), tables[i], sample=5,
                               draft_row=row[i] if on_device else -1) for i in range(2)]
            replays.clear()
            answers[on_device] = ex.step(Step(chunks, width=16 if graphs else 0,
                                              drafts=drafts if on_device else None))
            assert replays == ([16] if graphs else [])
            ex.close()
        assert answers[True].tokens == answers[False].tokens
        assert answers[True].accepted == {i: len(accept(proposed[i], answers[False].tokens[i])) - 1
                                          for i in range(2)} == {0: 4, 1: 1}
