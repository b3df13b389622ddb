"""Which SDPA kernels prefill attention may use on CUDA.

torch's cuDNN attention builds an execution plan for every new sequence length (measured on an
H200: 36 ms the first time a length is seen, 0.2 ms with flash), and serving traffic brings a new
prompt length with almost every request, so prefill attention excludes it: flash first, then the
memory-efficient kernel, then math. CPU calls are left as they are.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def prefill_kernels(device: torch.device) -> ContextManager:
    """Context in which ``F.scaled_dot_product_attention`` on ``device`` skips cuDNN."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
