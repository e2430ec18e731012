"""MLXExecutor behaviour: paged KV and block copies, selective logits, sampling, taps, errors, plugin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import GREEDY, Executor, SamplingParams, SeqChunk, Step
from musegl_core.engine.randomness import uniform
from musegl_core.errors import ConfigError
from musegl_core.plugins.specs import ExecutorOptions
from musegl_mlx.executor import MLXExecutor
from musegl_mlx.loader import checkpoint_weights

BLOCK = 4  # small blocks, so short prompts span several of them
TOL = 1e-5


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ex(tiny_hf) -> MLXExecutor:
    checkpoint = load_checkpoint(tiny_hf.path)
    executor = MLXExecutor(checkpoint.config, checkpoint_weights(checkpoint), checkpoint.name, dtype="float32",
                           block_size=BLOCK)
    executor.allocate_kv(64)
    return executor


def chunk(seq, tokens, start, blocks, **kw) -> SeqChunk:
    """A chunk; a sampled one gets its position-keyed uniform numbers, as the engine gives them."""
    positions = list(range(start, start + len(tokens)))
    params = kw.get("sampling", GREEDY)
    if kw.get("sample") and "uniforms" not in kw:
        n = int(kw["sample"])
        kw["uniforms"] = [uniform(params.seed or 0, p + 1) for p in positions[len(positions) - n:]]
    return SeqChunk(seq=seq, tokens=tokens, positions=positions, blocks=blocks, **kw)


def reference(model, prompt):
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0].numpy()


def test_protocol_info_and_kv_size(ex):
    assert isinstance(ex, Executor)
    assert ex.info.backend == "mlx" and ex.info.dtype == "float32" and not ex.info.vision
    assert (ex.info.vocab_size, ex.info.hidden_size, ex.info.num_layers) == (512, 64, 6)
    assert ex.kv_bytes_per_block() == 6 * 2 * BLOCK * 2 * 16 * 4
    assert ex.kv[0][0].shape == (64 * BLOCK, 2, 16)


def test_non_contiguous_blocks_and_decode_across_steps(ex, tiny_hf):
    prompt = ids(1, 21)
    ref = reference(tiny_hf.model, prompt)
    scattered = [40, 3, 17, 9, 61, 22]
    out = ex.step(Step([chunk(1, prompt[:13], 0, scattered, want_logits=True)]))
    assert np.allclose(out.logits[1], ref[12], atol=TOL)
    for p in range(13, 21):  # decode one token at a time, reading K/V written by earlier steps
        out = ex.step(Step([chunk(1, [prompt[p]], p, scattered, want_logits=True)]))
        assert np.allclose(out.logits[1], ref[p], atol=TOL), p


def test_copy_blocks_copies_every_layer(ex):
    prompt = ids(2, 8)
    ex.step(Step([chunk(2, prompt, 0, [30, 31], want_logits=True)]))
    ex.copy_blocks([(30, 50), (31, 51)])
    for kind in (0, 1):
        for layer in range(6):
            cache = np.array(ex.kv[kind][layer])
            assert np.array_equal(cache[50 * BLOCK:52 * BLOCK], cache[30 * BLOCK:32 * BLOCK])
    nxt = ids(3, 1)
    a = ex.step(Step([chunk(2, nxt, 8, [30, 31, 32], want_logits=True)]))
    b = ex.step(Step([chunk(4, nxt, 8, [50, 51, 52], want_logits=True)]))  # reads the copies
    assert np.array_equal(a.logits[2], b.logits[4])


def test_logits_and_tokens_only_where_asked(ex):
    out = ex.step(Step([
        chunk(10, ids(4, 5), 0, [0, 1]),
        chunk(11, ids(5, 3), 0, [2], sample=True),
        chunk(12, ids(6, 6), 0, [4, 5], want_logits=True),
        chunk(13, ids(7, 7), 0, [6, 7], logit_rows=True, sample=True),
    ]))
    assert set(out.tokens) == {11, 13} and set(out.logits) == {12, 13} and out.hidden == {}
    assert out.logits[12].shape == (512,) and out.logits[12].dtype == np.float32
    assert out.logits[13].shape == (7, 512)
    assert out.tokens[13] == [int(np.argmax(out.logits[13][-1]))]


def _sample_run(ex, seq, seed, others: bool, n: int = 6) -> list[int]:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed)
    base = 8 * (seq % 7)
    blocks = [base + i for i in range(4)]
    step_tokens, pos, tokens = ids(8, 6), 0, []
    for i in range(n):
        chunks = [chunk(seq, step_tokens, pos, blocks, sample=True, sampling=params)]
        if others:
            chunks.insert(0, chunk(seq + 100, ids(9 + i, 2), 2 * i, [56, 57, 58, 59], sample=True,
                                   sampling=SamplingParams(temperature=1.5, seed=i)))
        out = ex.step(Step(chunks))
        pos += len(step_tokens)
        tokens.append(out.tokens[seq][0])
        step_tokens = [tokens[-1]]
    return tokens


def test_seeded_sampling_is_independent_of_batch(ex):
    alone = _sample_run(ex, 20, seed=1234, others=False)
    assert alone == _sample_run(ex, 21, seed=1234, others=True)
    assert _sample_run(ex, 22, seed=99, others=False) != alone


def test_sampler_matches_the_torch_sampler_row_for_row():
    """The same logits, parameters, masks, penalties and uniforms give the same ids and
    log-probabilities as musegl_cuda's sampler (the contract's reference)."""
    import mlx.core as mx
    from musegl_cuda import sampling as torch_sampling
    from musegl_mlx import sampling as mlx_sampling

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (9, 300)).astype(np.float32)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie: lowest id wins
    mask = np.zeros(10, dtype=np.uint32)
    mask[1] = 0xF0F0  # a few ids of 32..63
    params = [GREEDY, SamplingParams(temperature=0.7, seed=1), SamplingParams(top_k=5, seed=2),
              SamplingParams(top_p=0.5, seed=3), SamplingParams(min_p=0.3, seed=4),
              SamplingParams(temperature=0.0, logit_bias=((7, 50.0),)),
              SamplingParams(temperature=1.3, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3,
                             seed=5),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.05, seed=6),
              SamplingParams(temperature=1.0, seed=7)]
    results = []
    for module, to_array in ((torch_sampling, torch.from_numpy), (mlx_sampling, mx.array)):
        rows = module.SampleRows()
        for i, p in enumerate(params):
            rows.params.append(p)
            rows.uniforms.append(float(rng.uniform()) if module is torch_sampling else None)
            rows.masks.append(mask if i == 8 else None)
            rows.counted.append(([3, 3, 4, 200, 200, 200], 2) if p.penalized else ((), 0))
            rows.logprobs.append(3)
        results.append((rows, module, to_array))
    results[1][0].uniforms[:] = results[0][0].uniforms
    (t_ids, t_lp), (m_ids, m_lp) = (module.sample(to_array(logits.copy()), rows) for rows, module, to_array in results)
    assert t_ids == m_ids
    assert t_ids[0] == 5 and t_ids[5] == 7 and 32 <= t_ids[8] < 64
    for a, b in zip(t_lp, m_lp):  # (ties among the top ids may come in either order)
        assert abs(a.logprob - b.logprob) < 1e-4 and set(a.top_ids) == set(b.top_ids)
        assert np.allclose(a.top_logprobs, b.top_logprobs, atol=1e-4)


def test_taps_shape_and_values(ex, tiny_hf):
    prompt = ids(11, 10)
    out = ex.step(Step([chunk(40, prompt, 0, [14, 15, 16]), chunk(41, prompt[:3], 0, [17])], taps=(0, 2, 6)))
    assert out.hidden[40].shape == (3, 10, 64) and out.hidden[41].shape == (3, 3, 64)
    with torch.no_grad():
        ref = tiny_hf.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for i, layer in enumerate((0, 2)):  # input residual of layer k == transformers hidden_states[k]
        assert np.allclose(np.array(out.hidden[40][i]), ref[layer][0].numpy(), atol=TOL), layer


def test_bad_steps_are_rejected(ex):
    with pytest.raises(ValueError, match="block table"):
        ex.step(Step([chunk(50, ids(12, 9), 0, [1, 2])]))
    with pytest.raises(ValueError, match="vocabulary"):
        ex.step(Step([chunk(50, [600], 0, [1])]))
    with pytest.raises(ValueError, match="block ids"):
        ex.step(Step([chunk(50, [1], 0, [64])]))
    with pytest.raises(ValueError, match="without a vision projector"):
        ex.embed_image(None)


def test_plugin_spec_factory_and_selection(tiny_gguf):
    from musegl_core.plugins.manager import PluginManager
    from musegl_mlx import plugin

    (spec,) = plugin.musegl_executors()
    assert spec.name == "mlx" and spec.available() and spec.unavailable_reason() is None
    assert spec.priority == (plugin.APPLE_PRIORITY if plugin.apple_silicon() else plugin.OTHER_PRIORITY)
    manager = PluginManager(only=["cuda", "mlx"])
    assert manager.choose_executor("mlx").name == "mlx"
    assert manager.choose_executor().name == ("mlx" if plugin.apple_silicon() else "torch-cpu")
    calls = []
    executor = spec.create(ExecutorOptions(model=str(tiny_gguf), dtype="float32",
                                           progress=lambda d, t, w: calls.append((d, t))))
    assert executor.info.backend == "mlx" and executor.info.name == "Tiny Muse Glimmer"
    assert calls[-1] == (3 + 6 * 12, 3 + 6 * 12)
    assert spec.kv_layout(ExecutorOptions(model=str(tiny_gguf), dtype="float32")) == (
        executor.kv_bytes_per_block(), executor.block_size)
    executor.close()
    with pytest.raises(ConfigError, match="--device"):
        spec.create(ExecutorOptions(model=str(tiny_gguf), device="cuda:0"))


def test_missing_mlx_is_one_line_and_exit_2_only_when_asked(tmp_path, tiny_gguf):
    """With MLX unimportable, `--executor mlx` stops with one line (exit status 2); the
    default executor choice ignores the plugin."""
    import os
    import subprocess
    import sys

    (tmp_path / "mlx").mkdir()
    (tmp_path / "mlx" / "__init__.py").write_text("raise ImportError('no MLX here (test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    base = [sys.executable, "-m", "musegl_core.cli.main", "generate", "--model", str(tiny_gguf),
            "--token-ids", "5,6,7", "--max-tokens", "2", "--json"]
    asked = subprocess.run(base + ["--executor", "mlx"], capture_output=True, text=True, env=env, timeout=300)
    assert asked.returncode == 2
    lines = asked.stderr.strip().splitlines()
    assert len(lines) == 1 and "executor 'mlx' cannot run on this machine: MLX is not usable here" in lines[0]
    default = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    assert default.returncode == 0, default.stderr
