"""A local Hugging Face model directory: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
from collections.abc import Iterator
from pathlib import Path


from ..models.config import ModelConfig
from .errors import ModelLoadError

if TYPE_CHECKING:
    import torch


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(str(path), "the directory has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(str(path), f"config.json is not valid JSON ({e})") from e
    try:
        return ModelConfig.from_hf(raw)
    except KeyError as e:
        raise ModelLoadError(str(path), f"config.json lacks the field {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(str(path), f"config.json is not usable ({e})") from e


def shard_files(path: Path) -> list[Path]:
    """Safetensors files: from ``model.safetensors.index.json`` when present, else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(str(path), f"model.safetensors.index.json is malformed ({e})") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(str(path), f"shards listed in the index are missing: {absent[:3]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(path), "the directory has no *.safetensors weights")
    return files


def _read_error(path: Path, f: Path, e: Exception) -> ModelLoadError:
    return ModelLoadError(str(path), f"cannot read {f.name} ({type(e).__name__}: {e})")


def _is_read_error(e: Exception) -> bool:
    # safetensors' SafetensorError does not derive from a standard exception in every version
    return isinstance(e, (OSError, ValueError)) or type(e).__name__ == "SafetensorError"


def count_tensors(path: Path, files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                total += len(h.keys())
        except Exception as e:
            if _is_read_error(e):
                raise _read_error(path, f, e) from e
            raise
    return total


def iter_tensors(path: Path, files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    yield name, h.get_tensor(name)
        except Exception as e:
            if _is_read_error(e):
                raise _read_error(path, f, e) from e
            raise
