"""Fused elementwise kernels of the decoder layer on CUDA (Triton): RMSNorm, SiLU(gate) * up, RoPE.

Unfused, these are ~30 % of a 2K-token prefill step on an H200 (one kernel per torch op, fp32
intermediates written to memory: docs/gpu-serving.md). Each kernel keeps the torch reference's
arithmetic and rounding points (fp32 math, a cast to the activation dtype wherever the reference
rounds), so outputs equal the reference up to fp32 summation order. Every kernel works row by row
(one program per token row, or per row and head), so a row's result does not depend on how many
rows the step has (XP ranks and one rank agree), and no argument varies with the row count except
the grid (nothing recompiles per step size; safe inside CUDA-graph capture after one warm-up).
``use_fused(x)`` is False on CPU and without Triton: callers then run the torch reference.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def use_fused(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:

    @triton.jit
    def _rms_norm(X, W, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        y = (x * r).to(Y.dtype.element_ty).to(tl.float32)  # the reference casts, then scales
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + offs, (w * y).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul(GU, OUT, stride_gu, stride_out, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < N
        g = tl.load(GU + row * stride_gu + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + N + col, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)  # F.silu rounds here
        tl.store(OUT + row * stride_out + col, (s * u).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope(X, COS, SIN, OUT, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
              HALF: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, HALF)
        x1 = tl.load(X + t * stride_xt + h * stride_xh + offs).to(tl.float32)
        x2 = tl.load(X + t * stride_xt + h * stride_xh + HALF + offs).to(tl.float32)
        c1 = tl.load(COS + t * stride_ct + offs).to(tl.float32)
        c2 = tl.load(COS + t * stride_ct + HALF + offs).to(tl.float32)
        s1 = tl.load(SIN + t * stride_ct + offs).to(tl.float32)
        s2 = tl.load(SIN + t * stride_ct + HALF + offs).to(tl.float32)
        ty = OUT.dtype.element_ty
        # reference: x * cos + cat(-x2, x1) * sin, each product rounded, then the sum
        o1 = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
        o2 = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
        tl.store(OUT + t * stride_ot + h * stride_oh + offs, o1.to(ty))
        tl.store(OUT + t * stride_ot + h * stride_oh + HALF + offs, o2.to(ty))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] (last dim contiguous) -> weight * (x / rms(x)) in x's dtype."""
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm[(x.shape[0],)](x, weight, y, x.stride(0), y.stride(0), n, eps,
                                 BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 4096 else 4)
    return y


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
    out = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = 1024
        _silu_mul[(gate_up.shape[0], triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                inter, BLOCK=block, num_warps=4)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (last dim contiguous), cos/sin [T, 1, D] -> rotated x, contiguous [T, H, D]."""
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        _rope[(t, h)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                      HALF=d // 2, num_warps=1)
    return out


def can_rope(x: torch.Tensor, cos: torch.Tensor) -> bool:
    d = x.shape[-1]
    return (use_fused(x) and x.dim() == 3 and x.stride(-1) == 1 and cos.stride(-1) == 1 and d % 2 == 0
            and (d // 2) & (d // 2 - 1) == 0 and cos.dtype == x.dtype)
