"""A GGUF file (llama.cpp): metadata -> ``ModelConfig``; tensors dequantized to HF names and layout.

llama.cpp's converter permutes the rows of Llama's q/k projections (to pair rotary dimensions
interleaved); we undo it so the rotate-half RoPE applies::

    gguf rows, per head:  [d0 d(D/2) d1 d(D/2+1) ...]   ->   HF rows: [d0 d1 ... | d(D/2) ...]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math
import mmap
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..models.config import ModelConfig
from . import gguf_meta
from .errors import ModelLoadError
from .gguf_meta import GGUFHeader

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


def read_header(path: Path) -> GGUFHeader:
    """The metadata and tensor names (fast path, ``gguf_meta``); where that reader does not parse the
    file, the ``gguf`` package's full reader (which also says what is wrong with a bad file)."""
    try:
        return gguf_meta.read_header(path)
    except gguf_meta.GGUFFormatError:
        reader = open_reader(path)
        fields = {k: _full_reader_value(f) for k, f in reader.fields.items()}
        return GGUFHeader(fields, frozenset(t.name for t in reader.tensors))
    except OSError as e:
        raise ModelLoadError(str(path), f"cannot read it ({e})") from e


def _full_reader_value(f) -> Any:
    """A ``gguf.ReaderField`` as ``gguf_meta`` gives it: scalars and strings as values, arrays by length."""
    import gguf

    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        return gguf_meta.ArrayField(int(f.types[-1]), len(f.data))
    return f.contents()


def read_config(path: Path, header: GGUFHeader) -> ModelConfig:
    field = header.get
    arch = field("general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ModelLoadError(str(path), f"GGUF architecture {arch!r} is not supported (llama, qwen3)")
    names = header.tensor_names
    if "rope_freqs.weight" in names:
        raise ModelLoadError(str(path), "GGUF with precomputed rope_freqs (llama3 scaling) is not supported; "
                                        "use the Hugging Face directory instead")
    try:
        heads = int(field(f"{arch}.attention.head_count"))
        hidden = int(field(f"{arch}.embedding_length"))
        tokens = field("tokenizer.ggml.tokens")
        vocab = field(f"{arch}.vocab_size") or (tokens.count if isinstance(tokens, gguf_meta.ArrayField) else None)
        eos = field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
            num_hidden_layers=int(field(f"{arch}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(field(f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            qk_norm=arch == "qwen3",
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
        )
    except (TypeError, KeyError, ValueError) as e:
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


def dequantize(path: Path, name: str, data: np.ndarray, qtype, dims: tuple[int, ...]) -> torch.Tensor:
    """``data``: the tensor's bytes (or the full reader's view of them) -> float32 tensor, HF layout."""
    import gguf
    import torch

    if qtype.name not in SUPPORTED_TYPES:
        raise ModelLoadError(str(path), f"tensor {name} has unsupported type {qtype.name}")
    blocks = getattr(gguf.quants, qtype.name, None)  # the type's block codec (Q8_0, Q4_1, Q4_K, BF16, ...)
    if blocks is not None and hasattr(blocks, "dequantize_blocks"):
        # every block of the tensor in one vectorized call (gguf's own dequantize loops over row groups:
        # ≈ 5× slower on SmolLM2's Q4_1 file)
        type_size = gguf.GGML_QUANT_SIZES[qtype][1]
        arr = blocks.dequantize_blocks(np.ascontiguousarray(data).reshape(-1, type_size))
    else:  # F32 / F16: views
        arr = gguf.quants.dequantize(data, qtype)
    shape = tuple(int(x) for x in reversed(dims))  # gguf lists dims innermost first
    return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))  # copy: file memory is read-only


def _raw_tensors(path: Path, header: GGUFHeader) -> Iterator[tuple[str, np.ndarray, Any, tuple[int, ...]]]:
    """(name, bytes as uint8 rows, ggml type, dims) from the header's tensor table over one mmap of the file:
    plain ndarray views (numpy's memmap subclass costs seconds of per-view overhead in gguf's dequantizers)."""
    import gguf

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # unmapped when the last view is gone
    for t in header.tensors:
        try:
            qtype = gguf.GGMLQuantizationType(t.type_id)
        except ValueError:
            raise ModelLoadError(str(path), f"tensor {t.name} has unknown ggml type {t.type_id}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if not t.dims or t.dims[0] % block:
            raise ModelLoadError(str(path), f"tensor {t.name}: dims {t.dims} do not fit {qtype.name} blocks")
        row_bytes = t.dims[0] // block * type_size
        rows = math.prod(t.dims[1:])
        if t.offset + rows * row_bytes > len(mm):
            raise ModelLoadError(str(path), f"truncated: tensor {t.name} ends past the end of the file")
        raw = np.frombuffer(mm, dtype=np.uint8, count=rows * row_bytes, offset=t.offset)
        yield t.name, raw.reshape(rows, row_bytes), qtype, t.dims


def _reader_tensors(path: Path) -> Iterator[tuple[str, np.ndarray, Any, tuple[int, ...]]]:
    """The same from the ``gguf`` package's full reader (files the fast header reader does not parse)."""
    for t in open_reader(path).tensors:
        yield t.name, t.data, t.tensor_type, tuple(int(x) for x in t.shape)


def iter_tensors(path: Path, header: GGUFHeader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) one at a time, q/k un-permuted for Llama."""
    source = _raw_tensors(path, header) if header.tensors else _reader_tensors(path)
    for gguf_name, data, qtype, dims in source:
        name = hf_name(gguf_name)
        if name is None:
            continue
        w = dequantize(path, gguf_name, data, qtype, dims)
        del data
        if config.architecture == "llama" and name.endswith("q_proj.weight"):
            w = unpermute(w, config.num_attention_heads)
        elif config.architecture == "llama" and name.endswith("k_proj.weight"):
            w = unpermute(w, config.num_key_value_heads)
        yield name, w


def count_tensors(path: Path, header: GGUFHeader) -> int:
    return len(header.tensors) if header.tensors else len(open_reader(path).tensors)
