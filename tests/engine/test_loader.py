"""Model resolution and loading: one clear ``ModelLoadError`` for every missing or malformed model."""

from __future__ import annotations

import json

import pytest
import torch

from conflux_cluster.engine.loader import ModelLoadError, load_model, resolve_model
from conflux_cluster.engine.loader.gguf_file import unpermute
from conflux_cluster.engine.models.config import ModelConfig

from .helpers import hf_tiny_model, save_hf


def test_unknown_name_lists_builtin_names():
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct.*qwen3-14b"):
        resolve_model("no-such-model-xyz")


def test_directory_problems(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="model_type='gpt2' is not supported"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match="lacks the field 'num_attention_heads'"):
        resolve_model(str(tmp_path))


def test_missing_and_wrong_weights(tmp_path):
    hf = hf_tiny_model("qwen3")
    path = save_hf(hf, tmp_path / "m")
    weights = path / "model.safetensors"
    weights.rename(tmp_path / "elsewhere.safetensors")
    src = resolve_model(str(path))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(src, torch.float32, "cpu", progress=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "elsewhere.safetensors"))
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="missing, e.g. \\['model.layers.1.mlp.up_proj.weight'\\]"):
        load_model(src, torch.float32, "cpu", progress=False)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(weights))
    with pytest.raises(ModelLoadError, match="shape \\(3, 3\\)"):
        load_model(src, torch.float32, "cpu", progress=False)
    weights.write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="cannot read model.safetensors"):
        load_model(src, torch.float32, "cpu", progress=False)


def test_bad_gguf_and_wrong_file_type(tmp_path):
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        resolve_model(str(bad))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="must be a .gguf file"):
        resolve_model(str(other))


def test_old_style_rope_scaling_config_is_understood():
    cfg = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}, "eos_token_id": [128001, 128009]})
    assert cfg.head_dim == 128 and cfg.rope_scaling.factor == 8.0 and cfg.eos_token_ids == [128001, 128009]
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "rope_scaling": {"type": "yarn"}})


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, d, hidden = 3, 8, 5
    w = torch.randn(n_head * d, hidden)
    # llama.cpp's convert_hf_to_gguf permute:
    permuted = w.reshape(n_head, 2, d // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute(permuted, n_head), w)


def test_random_presets_build():
    src = resolve_model("tiny-qwen3")
    model = load_model(src, torch.float32, "cpu", progress=False)
    assert src.kind == "preset" and model.config.qk_norm
    assert resolve_model("llama-3.1-8b").config.rope_scaling is not None


def test_gguf_header_reader_equals_the_full_reader_and_falls_back_on_bad_files(tmp_path):
    """The fast metadata reader (engine/loader/gguf_meta.py) gives the full ``gguf`` reader's fields,
    tensor names and config on the bundled SmolLM2 file; truncated or empty files still get the full
    reader's clear error."""
    from conflux_cluster.engine.loader import gguf_file, gguf_meta, smollm2_path

    path = smollm2_path()
    fast = gguf_meta.read_header(path)
    reader = gguf_file.open_reader(path)
    full = {k: gguf_file._full_reader_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fast.fields == full and fast.tensor_names == {t.name for t in reader.tensors}
    assert isinstance(fast.fields["tokenizer.ggml.tokens"], gguf_meta.ArrayField)
    assert fast.fields["tokenizer.ggml.tokens"].count == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert gguf_file.read_config(path, fast) == gguf_file.read_config(path, gguf_meta.GGUFHeader(full, fast.tensor_names))
    # the tensor table: the full reader's names, dims, types and absolute data offsets
    assert [(t.name, t.dims, t.type_id, t.offset) for t in fast.tensors] == [
        (t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), int(t.data_offset)) for t in reader.tensors]
    data = path.read_bytes()
    for name, blob in (("truncated.gguf", data[:4096]), ("empty.gguf", b""), ("swapped.gguf", data[:4] + data[4:8][::-1] + data[8:4096])):
        bad = tmp_path / name
        bad.write_bytes(blob)
        with pytest.raises(gguf_meta.GGUFFormatError):
            gguf_meta.read_header(bad)
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            resolve_model(str(bad))


def test_gguf_tensors_from_the_header_table_equal_the_full_readers(tmp_path):
    """The loader dequantizes from the fast reader's tensor table over one mmap (every block of a tensor
    in one call): the same float32 weights as the ``gguf`` package's full reader, for every tensor type
    the bundled file holds (Q4_1, Q8_0, F32); a file cut inside its tensor data is a clear error."""
    import itertools

    from conflux_cluster.engine.loader import gguf_file, gguf_meta, smollm2_path

    path = smollm2_path()
    src = resolve_model(str(path))
    header = gguf_meta.read_header(path)
    types = {t.type_id for t in header.tensors}
    assert len(types) >= 3
    n = 40  # the embedding, 4 layers' worth and the types above; the whole file takes the full reader ~10 s
    fast = list(itertools.islice(gguf_file.iter_tensors(path, header, src.config), n))
    slow = list(itertools.islice(gguf_file.iter_tensors(path, gguf_meta.GGUFHeader(header.fields, header.tensor_names),
                                                        src.config), n))
    assert [k for k, _ in fast] == [k for k, _ in slow]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fast, slow))
    assert {header.tensors[i].type_id for i in range(n)} == types
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(ModelLoadError, match="truncated: tensor .* ends past the end of the file"):
        load_model(resolve_model(str(cut)), torch.float32, "cpu", progress=False)
