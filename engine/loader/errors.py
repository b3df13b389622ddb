"""The one error users see when a model cannot be found or read."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A missing or malformed model. The message names the model, the problem and what is expected."""

    def __init__(self, model: str, problem: str) -> None:
        super().__init__(
            f"cannot load model {model!r}: {problem}. Expected a local Hugging Face directory "
            f"(config.json + *.safetensors + tokenizer.json), a .gguf file, or a built-in name "
            f"(see `conflux_cluster.engine.loader.builtin_names()`).")
        self.model = model
        self.problem = problem
