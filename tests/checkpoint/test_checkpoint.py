"""Checkpoint readers and the GGUF writer (numpy only)."""

from __future__ import annotations

import json
import math
import types

import gguf
import numpy as np
import pytest

from musegl_core.testing.reference_models import tiny_tokenizer_data
from musegl_core.checkpoint.gguf_reader import dequantize_rows, permute_rope_rows, unpermute_rope_rows
from musegl_core.checkpoint.gguf_writer import write_text_gguf
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS, text_weight_names
from musegl_core.checkpoint.loader import load_checkpoint

A = "muse-glimmer"


@pytest.fixture(scope="module")
def hf_weights(tiny_hf):
    checkpoint = load_checkpoint(tiny_hf.path)
    return checkpoint.config, dict(checkpoint.iter_weights())


def state_dict_text(model) -> dict[str, np.ndarray]:
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.language_model."):
            out[name.removeprefix("model.language_model.")] = tensor.float().numpy()
    out["lm_head.weight"] = model.lm_head.weight.float().detach().numpy()
    return out


def is_centered(name: str) -> bool:
    return name.split(".", 2)[-1] in CENTERED_NORMS


def test_hf_directory_reads_transformers_weights(tiny_hf, hf_weights):
    config, weights = hf_weights
    reference = state_dict_text(tiny_hf.model)
    assert set(weights) == set(text_weight_names(config))
    for name, value in weights.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, reference[name], err_msg=name)
    assert config.num_layers == 6 and config.vocab_size == 512 and config.head_dim == 16
    assert config.sliding == config.rope == (True, False, True, True, True, False)
    assert config.rope_theta == 10000.0 and config.sliding_window == 8
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_progress_is_reported_per_tensor(tiny_hf):
    calls = []
    checkpoint = load_checkpoint(tiny_hf.path, progress=lambda done, total, what: calls.append((done, total, what)))
    names = [name for name, _ in checkpoint.iter_weights()]
    assert [c[2] for c in calls] == names == list(checkpoint.tensor_names)
    assert calls[-1][:2] == (checkpoint.num_tensors, checkpoint.num_tensors)


def test_permutation_round_trip():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    p = permute_rope_rows(w, 8)
    # per head, new row 2j+s takes old row s*half+j
    assert np.array_equal(p[2 * 3 + 1], w[8 + 3]) and np.array_equal(p[16 + 2 * 5], w[16 + 5])
    assert np.array_equal(unpermute_rope_rows(p, 8), w)


def test_gguf_f32_round_trip_is_exact(tiny_gguf, hf_weights):
    config, weights = hf_weights
    checkpoint = load_checkpoint(tiny_gguf)
    assert checkpoint.source == "gguf" and checkpoint.file_type == "f32"
    assert checkpoint.name == "Tiny Muse Glimmer"
    got = dict(checkpoint.iter_weights())
    assert list(got) == list(text_weight_names(config))
    for name, value in got.items():
        if is_centered(name):  # w' = gguf_w - 1 reproduces 1 + w bit for bit
            np.testing.assert_array_equal(np.float32(1) + value, np.float32(1) + weights[name], err_msg=name)
        else:
            np.testing.assert_array_equal(value, weights[name], err_msg=name)
    c = checkpoint.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == \
        (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, 512)
    assert c.sliding == c.rope == config.sliding and c.sliding_window == 8
    assert c.qk_scale_factor == pytest.approx(3.87, rel=1e-7)
    assert c.output_multiplier == pytest.approx(config.output_multiplier, rel=1e-7)
    assert c.final_logit_softcapping == 20.0 and c.rope_theta == 10000.0
    assert c.max_position_embeddings == config.max_position_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert checkpoint.tokenizer == tiny_tokenizer_data()


def test_gguf_metadata_and_tensor_layout(tiny_gguf, hf_weights):
    config, weights = hf_weights
    reader = gguf.GGUFReader(tiny_gguf)
    f = lambda key: reader.fields[key].contents()  # noqa: E731
    assert f("general.architecture") == A and f("general.type") == "model"
    assert f("general.file_type") == 0 and f("general.quantization_version") == 2
    expected = {
        f"{A}.block_count": 6, f"{A}.context_length": 4096, f"{A}.embedding_length": 64,
        f"{A}.feed_forward_length": 128, f"{A}.attention.head_count": 4, f"{A}.attention.head_count_kv": 2,
        f"{A}.attention.key_length": 16, f"{A}.attention.value_length": 16, f"{A}.attention.sliding_window": 8,
    }
    for key, value in expected.items():
        assert f(key) == value, key
        assert reader.fields[key].types == [gguf.GGUFValueType.UINT32], key
    assert f(f"{A}.attention.sliding_window_pattern") == [True, False, True, True, True, False]
    assert reader.fields[f"{A}.attention.sliding_window_pattern"].types[-1] == gguf.GGUFValueType.BOOL
    assert f(f"{A}.rope.freq_base") == 10000.0
    assert f(f"{A}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert f(f"{A}.final_logit_softcapping") == 20.0
    assert f(f"{A}.logit_scale") == np.float32(0.19611613513818404)
    assert f"{A}.vocab_size" not in reader.fields
    assert f("tokenizer.ggml.model") == "gpt2" and f("tokenizer.ggml.pre") == "llama4"
    assert f("tokenizer.ggml.tokens")[:4] == ["<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot|>"]
    assert len(f("tokenizer.ggml.token_type")) == 512 and f("tokenizer.ggml.merges") == ["t o", "to k"]
    assert (f("tokenizer.ggml.bos_token_id"), f("tokenizer.ggml.eos_token_id"),
            f("tokenizer.ggml.eot_token_id"), f("tokenizer.ggml.padding_token_id")) == (1, 2, 3, 0)
    assert f("tokenizer.ggml.add_bos_token") is False and f("tokenizer.chat_template") == "{{ messages }}"

    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 3 + 6 * 14
    q = tensors["blk.2.attn_q.weight"]
    assert list(q.shape) == [64, 64] and q.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(q.data, permute_rope_rows(weights["layers.2.self_attn.q_proj.weight"], 4))
    np.testing.assert_array_equal(tensors["blk.0.attn_k.weight"].data,
                                  permute_rope_rows(weights["layers.0.self_attn.k_proj.weight"], 2))
    assert list(tensors["blk.0.attn_k.weight"].shape) == [64, 32]
    np.testing.assert_array_equal(tensors["blk.1.ffn_norm.weight"].data,
                                  weights["layers.1.pre_feedforward_layernorm.weight"] + np.float32(1))
    np.testing.assert_array_equal(tensors["output_norm.weight"].data, weights["norm.weight"])
    assert np.all(tensors["blk.3.attn_q_norm.weight"].data == np.float32(3.87))
    assert np.all(tensors["blk.3.attn_k_norm.weight"].data == 1.0)
    assert list(tensors["output.weight"].shape) == [64, 512]


@pytest.mark.parametrize("file_type,qtype", [("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_gguf_quantized_round_trip(tmp_path, hf_weights, file_type, qtype):
    config, weights = hf_weights
    path = tmp_path / f"m-{file_type}.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(), file_type=file_type)
    checkpoint = load_checkpoint(path)
    assert checkpoint.file_type == file_type
    reader = gguf.GGUFReader(path)
    types_by_name = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types_by_name["blk.0.attn_q.weight"] == qtype and types_by_name["token_embd.weight"] == qtype
    assert all(types_by_name[n] == "F32" for n in types_by_name if n.endswith("_norm.weight"))
    gtype = gguf.GGMLQuantizationType[qtype]
    for name, value in checkpoint.iter_weights():
        ref = weights[name]
        if value.ndim == 1:
            if is_centered(name):
                np.testing.assert_array_equal(np.float32(1) + value, np.float32(1) + ref)
            else:
                np.testing.assert_array_equal(value, ref)
            continue
        # Rows quantize independently, so the RoPE permutation commutes with the codec.
        expected = gguf.quants.dequantize(gguf.quants.quantize(ref, gtype), gtype).reshape(ref.shape)
        np.testing.assert_allclose(value, expected, rtol=0, atol=1e-7, err_msg=name)
        bound = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2}[qtype] * float(np.abs(ref).max())
        assert float(np.abs(value - ref).max()) <= bound, name


def test_fused_qkv(tmp_path, hf_weights):
    config, weights = hf_weights
    path = tmp_path / "fused.gguf"
    write_text_gguf(path, config, weights, tiny_tokenizer_data(), fuse_qkv=True)
    names = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert len(names) == 3 + 6 * 12
    assert "blk.0.attn_q.weight" not in names and list(names["blk.0.attn_qkv.weight"].shape) == [64, 64 + 32 + 32]
    got = dict(load_checkpoint(path).iter_weights())
    for suffix in ("q_proj", "k_proj", "v_proj"):
        name = f"layers.4.self_attn.{suffix}.weight"
        np.testing.assert_array_equal(got[name], weights[name])


def _write_tensor_bytes(path, tensor_name: str, values: np.ndarray) -> None:
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == tensor_name)
    with open(path, "r+b") as f:
        f.seek(tensor.data_offset)
        f.write(values.astype(np.float32).tobytes())


def test_bad_qk_norms_are_rejected(tmp_path, hf_weights):
    config, weights = hf_weights
    for tensor_name, values, message in [
        ("blk.1.attn_q_norm.weight", np.r_[np.full(15, 3.87), 1.0], "not constant"),
        ("blk.2.attn_q_norm.weight", np.full(16, 2.0), "differs between layers"),
        ("blk.0.attn_k_norm.weight", np.full(16, 2.0), "not all ones"),
    ]:
        path = tmp_path / f"{tensor_name}.gguf"
        write_text_gguf(path, config, weights, tiny_tokenizer_data())
        _write_tensor_bytes(path, tensor_name, values)
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path)


def test_wrong_architecture_is_rejected(tmp_path):
    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture is 'llama'"):
        load_checkpoint(path)
    (tmp_path / "junk.bin").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_checkpoint(tmp_path / "junk.bin")
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing")


def test_undecodable_tensor_type_is_named():
    fake = types.SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=gguf.GGMLQuantizationType.Q8_K,
                                 shape=np.array([256, 2]), data=np.zeros((2, 292), dtype=np.uint8))
    with pytest.raises(ValueError, match="Q8_K cannot be decoded"):
        dequantize_rows(fake)


def test_sharded_bf16_safetensors(tmp_path, tiny_hf):
    import copy

    import torch

    model = copy.deepcopy(tiny_hf.model).to(torch.bfloat16)  # the shared fixture stays float32
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    reference = state_dict_text(model)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.source == "hf" and checkpoint.file_type == "bf16"
    for name, value in checkpoint.iter_weights():
        np.testing.assert_array_equal(value, reference[name], err_msg=name)


def test_bare_text_config_defaults(tmp_path):
    """A ``muse_glimmer_text`` config.json with most fields absent takes the class defaults."""
    from safetensors.numpy import save_file

    text = {"model_type": "muse_glimmer_text", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(text))
    from musegl_core.checkpoint.hf_reader import expected_shape, text_config_from_dict

    checkpoint_config = text_config_from_dict(text)
    rng = np.random.default_rng(0)
    tensors = {f"model.{n}" if n != "lm_head.weight" else n:
               rng.standard_normal(expected_shape(checkpoint_config, n)).astype(np.float32)
               for n in text_weight_names(checkpoint_config)}
    tensors["model.vision_tower.patch.weight"] = np.zeros((2, 2), dtype=np.float32)  # ignored
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = load_checkpoint(tmp_path)
    c = checkpoint.config
    assert c.sliding == c.rope == (False, True, True, True, False)  # full on 4, 0 counted back from 4
    assert c.rope_theta == 10000.0 and c.sliding_window == 2048 and c.qk_scale_factor == 3.87
    assert c.post_norm_eps == 1e-8 and c.final_logit_softcapping == 20.0
    assert c.bos_token_id == 200000 and c.eos_token_ids == (200001,)
    assert math.isclose(c.output_multiplier, 0.19611613513818404)
    np.testing.assert_array_equal(checkpoint.read("lm_head.weight"), tensors["lm_head.weight"])


def test_read_text_config_needs_no_weights(tmp_path, tiny_hf, tiny_gguf):
    """:func:`read_text_config` reads a directory's config.json (or the file itself) with
    no safetensors beside it, and a GGUF's metadata, to the config the loader gives."""
    from musegl_core.checkpoint.loader import read_text_config

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_hf.path / "config.json").read_text())
    want = load_checkpoint(tiny_hf.path).config
    assert read_text_config(bare) == (want, "bare")
    assert read_text_config(bare / "config.json") == (want, "bare")
    gguf_checkpoint = load_checkpoint(tiny_gguf)
    assert read_text_config(tiny_gguf) == (gguf_checkpoint.config, gguf_checkpoint.name)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_text_config(tmp_path)
