"""The GPU tests' step helpers, run on the CPU executor: ``test_gpu_quantized.py``'s greedy and
prompt-logits helpers and ``test_kv_fp8_gpu.py``'s decode helper only run where a GPU is, so a
change of the step API (what :class:`~musegl_core.engine.executor.StepOutput` holds, when a
chunk samples) broke them unseen once (``KeyError`` reading the sampled ids,
benchmarks/results/gpu_quantized_2026-12-07_h100). Here the same functions read a CPU
executor's outputs, and what they return is checked against teacher-forced logits."""

from __future__ import annotations

import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_cuda.executor import TorchExecutor


def _executor(path) -> TorchExecutor:
    ex = TorchExecutor(load_checkpoint(path), device="cpu", dtype="float32")
    ex.allocate_kv(64)
    return ex


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_greedy_helper_returns_the_argmax_of_each_step(tiny_hf):
    from test_gpu_quantized import _greedy, _prompt_logits

    prompt = _prompt(1, 30)
    ids = _greedy(_executor(tiny_hf.path), prompt, 5)
    assert len(ids) == 6
    logits = _prompt_logits(_executor(tiny_hf.path), prompt + ids[:-1])  # every row, teacher-forced
    assert logits.shape[0] == len(prompt) + 5
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == ids


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("forced", [False, True])
def test_the_fp8_gpu_tests_decode_helper_reads_every_sequence_s_ids_and_logits(tiny_hf, rows, forced):
    from test_gpu_quantized import _prompt_logits
    from test_kv_fp8_gpu import _decode

    prompts = [_prompt(2 + i, n) for i, n in enumerate((7, 12, 5))]
    feed = [[40 + i, 50 + i, 60 + i] for i in range(3)] if forced else None  # teacher forcing
    ids, logits = _decode(_executor(tiny_hf.path), prompts, 3, rows, feed=feed)
    assert [len(i) for i in ids] == [4, 4, 4]
    assert len(logits) == 3 and all(t.shape == (load_checkpoint(tiny_hf.path).config.vocab_size,) for t in logits)
    reference = _executor(tiny_hf.path)  # each prompt from position 0: it writes every row it reads
    for i, prompt in enumerate(prompts):  # the sequence as fed: the prompt, then each fed id `rows` times
        fed = prompt + [t for t in (feed[i] if forced else ids[i][:-1]) for _ in range(rows)]
        want = _prompt_logits(reference, fed)
        assert want[len(prompt) - 1].argmax().item() == ids[i][0]
        assert [want[len(prompt) - 1 + rows * (s + 1)].argmax().item() for s in range(3)] == ids[i][1:]
        assert torch.allclose(logits[i], want[-1], atol=1e-4, rtol=1e-4)
