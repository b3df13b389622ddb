"""Linear layers at decode batch sizes on CUDA (Triton): ``y = x @ W.T (+ b)`` for ``x`` of few rows.

A decode step multiplies a handful of rows by every weight matrix: the work is reading the weights
once from HBM. cuBLAS at 1-8 rows reads them at 2.2-2.8 of the H100's 3.0 TB/s (docs/xp.md), which
left a batch-1 decode step at 1.5-1.6x its HBM roofline. This kernel streams ``W`` in
``[BLOCK_N, BLOCK_K]`` tiles along its contiguous K axis, one program per ``BLOCK_N`` output
columns over the whole of K (no split-K: the sum order of an output does not depend on the batch),
with the rows of ``x`` padded to ``BLOCK_M`` (>= 16, what ``tl.dot`` takes) and fp32 accumulation.
Every row is computed the same way whatever the batch, up to ``MAX_ROWS``; larger batches, GPUs
other than Hopper (the launch shapes' shared memory) and every CPU or non-bf16/fp16 call go to
``F.linear``. ``Linear`` is ``nn.Linear`` with that dispatch, and
its ``skinny`` attribute turns it off per module (the benchmarks' baseline in the same run).

Launch shapes: ``launch_config``, chosen by ``python -m benchmarks.steps gemv`` (cuBLAS and a grid of
launch shapes timed in CUDA graphs; docs/xp.md). Triton is a maintained compiler for exactly this
kind of memory-bound kernel; no maintained library ships a bf16 GEMV for these shapes (FlashInfer's
GEMMs are quantized or grouped; cuBLAS is the baseline it beats).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16  # rows of x up to which the kernel runs (cuBLAS beyond: benchmarks/steps/gemv.py)
ON_BY_DEFAULT = True  # a model's linears start with the kernel on (set_skinny switches a model)


class LaunchConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def launch_config(n: int, k: int) -> LaunchConfig:
    """The kernel's tile and pipeline for a ``[rows, k] x [k, n]`` product: per Llama-3.1-8B layer
    the grid's best over 1-16 rows (within 0.7 % of each shape's best; H100, docs/xp.md)."""
    if n >= 65536:  # the LM head
        return LaunchConfig(64, 256, 4, 5)
    if n >= 16384:  # gate_up
        return LaunchConfig(32, 128, 4, 3)
    if k >= 8192:  # down
        return LaunchConfig(32, 256, 4, 5)
    return LaunchConfig(32, 128, 4, 5)  # qkv, o


@functools.lru_cache(maxsize=None)
def _tuned_for(device_index: int) -> bool:
    """The launch shapes were chosen on Hopper (sm90: 228 KB of shared memory per SM, which the deepest
    pipelines use); other GPUs keep cuBLAS."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (triton is not None and x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.stride(1) == 1 and _tuned_for(x.device.index or 0))


if triton is not None:

    @triton.jit
    def _skinny_mm(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                   EVEN_K: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        rows_n = offs_n[:, None].to(tl.int64) if WIDE else offs_n[:, None]  # N x K past 2^31 elements
        w_ptrs = W + rows_n * stride_wn + offs_k[None, :]
        m_ok = offs_m[:, None] < M
        n_ok = offs_n[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_ok, other=0.0)
                w = tl.load(w_ptrs, mask=n_ok, other=0.0)
            else:
                k_ok = offs_k[None, :] < K - k0
                x = tl.load(x_ptrs, mask=m_ok & k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=n_ok & k_ok, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: LaunchConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``use_skinny(x, weight)`` inputs: x [M, K], weight [N, K]."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or launch_config(n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    _skinny_mm[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, WIDE=n * weight.stride(0) >= 2 ** 31,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, skinny: bool = True) -> torch.Tensor:
    """``F.linear`` with the skinny kernel for few rows on CUDA (``skinny=False``: always ``F.linear``)."""
    if skinny and use_skinny(x, weight):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward takes the skinny kernel for few rows on CUDA (``skinny = False``: never)."""

    skinny: bool = ON_BY_DEFAULT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny)


def set_skinny(model: nn.Module, on: bool) -> int:
    """Turn the skinny kernel on or off for every module of ``model`` that has the switch (each
    ``Linear``, and the model's LM head call); returns how many. Captured CUDA graphs keep what they
    captured: capture again after a change."""
    mods = [m for m in model.modules() if hasattr(type(m), "skinny")]
    for m in mods:
        m.skinny = on
    return len(mods)
