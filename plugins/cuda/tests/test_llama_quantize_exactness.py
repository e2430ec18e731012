"""Files quantized by llama.cpp's own ``llama-quantize`` (Q4_K_M, Q6_K, Q8_0), run as stored by
the torch-cpu executor: ``musegl generate`` is greedy-identical to transformers running the
file's weights dequantized, in float32 (slow: the first run builds llama-quantize from the
llama-cpp-python sdist into the musegl cache, see musegl_core/testing/llamacpp.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.gguf_file import GGUFFile
from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.fit import q4_k_m_types
from musegl_core.testing.quantized_files import WIDE_SHAPE, greedy_cli, llama_quantized, reference_greedy
from musegl_core.testing.quantized_reference import reference_with_weights
from musegl_core.testing.reference_models import build_tiny_model
from musegl_cuda.cpu import native
from musegl_cuda.cpu.stored_matrix import StoredMatrix

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(native.load() is None, reason="no stored-weight kernels here")]

KINDS = ("Q4_K_M", "Q6_K", "Q8_0")
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["tiny", "wide"])
def quantized(request, tiny_hf, tmp_path_factory):
    """(transformers model, {kind: GGUF}) for the tiny model (hidden 64: llama.cpp falls back
    to Q5_0/Q5_1/Q8_0 where rows do not fill 256-value blocks) and a wide one (hidden 256:
    every matrix a k-quant)."""
    from musegl_core.testing.llamacpp import LlamaCppUnavailable

    if request.param == "tiny":
        model, path = tiny_hf.model, tiny_hf.path
    else:
        model = build_tiny_model(seed=7, **WIDE_SHAPE)
        path = tmp_path_factory.mktemp("wide_hf")
        model.save_pretrained(path)
    try:
        files = llama_quantized(path, tmp_path_factory.mktemp(f"llama-{request.param}"), KINDS)
    except LlamaCppUnavailable as exc:
        pytest.fail(f"llama-quantize is needed for this test: {exc}")
    return request.param, model, files


def file_types(path) -> dict[str, str]:
    reader = GGUFFile(path, wanted=())
    try:
        return {name: t.tensor_type.name.lower() for name, t in reader.tensors.items() if t.data.ndim == 2}
    finally:
        reader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_llama_quantize_files_run_stored_and_greedy_match_transformers(quantized, kind):
    shape, model, files = quantized
    path = files[kind]
    types = file_types(path)
    checkpoint = load_checkpoint(path)
    if kind == "Q4_K_M":  # the start-up arithmetic's type rule is llama.cpp's
        assert {n: t for n, t in types.items()} == q4_k_m_types(checkpoint.config)
    if shape == "wide":  # every matrix runs on the kernels in its stored type
        for stored in checkpoint.iter_stored():
            if len(stored.shape) == 2:
                assert isinstance(StoredMatrix.from_stored(stored), StoredMatrix), stored.name
        assert set(types.values()) == ({"q4_k", "q6_k"} if kind == "Q4_K_M" else {kind.lower()})
    reference = reference_with_weights(model, checkpoint)
    checkpoint.close()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(21)).tolist()
    assert greedy_cli(path, "torch-cpu", ids, NEW_TOKENS) == reference_greedy(reference, ids, NEW_TOKENS)


def test_stored_kernels_give_the_reference_logits(quantized):
    """The Q4_K_M file's logits from the stored kernels within float32 rounding of transformers'."""
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    _, model, files = quantized
    checkpoint = load_checkpoint(files["Q4_K_M"])
    reference = reference_with_weights(model, checkpoint)
    ex = TorchExecutor(checkpoint, device="cpu", block_size=16)
    assert ex.weights == "stored"
    ex.allocate_kv(8)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(22)).tolist()
    out = ex.step(Step([SeqChunk(seq=0, tokens=ids, positions=list(range(40)), blocks=[0, 1, 2], logit_rows=True)]))
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert float(np.abs(out.logits[0].numpy() - ref).max()) <= 1e-4 * max(1.0, float(np.abs(ref).max()))


def test_a_q4_k_m_file_takes_its_own_size_in_memory(tmp_path_factory):
    """Resident memory (RssAnon) the torch-cpu executor adds loading a Q4_K_M file with the
    real vocabulary (so the file is ~75 MB: embedding Q4_K, head Q6_K) is at most 1.1x the
    file's tensor bytes, and the start-up arithmetic says the same bytes."""
    from musegl_core.engine.fit import checkpoint_tensor_bytes
    from musegl_core.testing.llamacpp import LlamaCppUnavailable
    from musegl_core.testing.quantized_files import resident_weight_bytes
    from musegl_cuda.memory_plan import stored_bytes
    from musegl_core.engine.fit import checkpoint_tensors

    model = build_tiny_model(seed=3, vocab_size=202048, num_hidden_layers=2, **WIDE_SHAPE)
    hf = tmp_path_factory.mktemp("big_hf")
    model.save_pretrained(hf)
    del model
    try:
        path = llama_quantized(hf, tmp_path_factory.mktemp("big_llama"), ("Q4_K_M",))["Q4_K_M"]
    except LlamaCppUnavailable as exc:
        pytest.fail(f"llama-quantize is needed for this test: {exc}")
    file_bytes = sum(checkpoint_tensor_bytes(path).values())
    assert sum(stored_bytes(t)[1] for t in checkpoint_tensors(path)) == file_bytes
    resident = resident_weight_bytes("torch-cpu", path)
    print(f"Q4_K_M on torch-cpu: resident {resident} of file {file_bytes} ({resident / file_bytes:.3f}x)")
    assert resident <= 1.1 * file_bytes
