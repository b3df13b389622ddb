"""A GGUF file (llama.cpp): metadata -> ``ModelConfig``; tensors dequantized to HF names and layout.

llama.cpp's converter permutes the rows of Llama's q/k projections (to pair rotary dimensions
interleaved); we undo it so the rotate-half RoPE applies::

    gguf rows, per head:  [d0 d(D/2) d1 d(D/2+1) ...]   ->   HF rows: [d0 d1 ... | d(D/2) ...]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..models.config import ModelConfig
from .errors import ModelLoadError

if TYPE_CHECKING:
    import torch

SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises assorted errors on bad magic / truncation
        raise ModelLoadError(str(path), f"not a readable GGUF file ({type(e).__name__}: {e})") from e


def field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(path: Path, reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ModelLoadError(str(path), f"GGUF architecture {arch!r} is not supported (llama, qwen3)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(str(path), "GGUF with precomputed rope_freqs (llama3 scaling) is not supported; "
                                        "use the Hugging Face directory instead")
    try:
        heads = int(field(reader, f"{arch}.attention.head_count"))
        hidden = int(field(reader, f"{arch}.embedding_length"))
        vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
        eos = field(reader, "tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
            num_hidden_layers=int(field(reader, f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(field(reader, f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            qk_norm=arch == "qwen3",
            bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
        )
    except (TypeError, KeyError) as e:
        raise ModelLoadError(str(path), f"GGUF metadata lacks a required field ({e})") from e


def hf_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        sub = _LAYER_NAMES.get(m.group(2))
        return None if sub is None else f"model.layers.{m.group(1)}.{sub}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    base = _GLOBAL_NAMES.get(stem)
    return None if base is None else f"{base}.{kind}"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. w: [n_head*D, ...] (rows grouped by head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(path: Path, tensor) -> torch.Tensor:
    import gguf
    import torch

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(str(path), f"tensor {tensor.name} has unsupported type {kind}")
    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(x) for x in reversed(tensor.shape))  # gguf lists dims innermost first
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # copy: reader memory is read-only


def iter_tensors(path: Path, reader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) one at a time, q/k un-permuted for Llama."""
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = dequantize(path, t)
        if config.architecture == "llama" and name.endswith("q_proj.weight"):
            w = unpermute(w, config.num_attention_heads)
        elif config.architecture == "llama" and name.endswith("k_proj.weight"):
            w = unpermute(w, config.num_key_value_heads)
        yield name, w
