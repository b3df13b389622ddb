"""Import ``conflux_cluster.engine`` modules without the package ``__init__`` chain.

The GPU machine has torch, Triton and NCCL but not pydantic or Ray; the XP attention, KV pool,
Triton kernels and CUDA-graph runner need neither. Importing this module first registers
namespace stubs for ``conflux_cluster`` and ``conflux_cluster.engine`` pointing at the repository
folders (what setup.py's package-dir map does for an installed package).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
for _name, _folder in (("conflux_cluster", "conflux_cluster"), ("conflux_cluster.engine", "engine")):
    if _name not in sys.modules:
        _m = types.ModuleType(_name)
        _m.__path__ = [str(_REPO / _folder)]
        sys.modules[_name] = _m
