"""Where ConfluxServe keeps what it computes once per machine: ``$CONFLUX_CACHE_DIR``, else
``$XDG_CACHE_HOME/conflux``, else ``~/.cache/conflux`` (fitted estimator profiles, converted tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("CONFLUX_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "conflux"
