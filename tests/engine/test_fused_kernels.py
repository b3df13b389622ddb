"""The fused decoder-layer kernels (engine/models/fused.py) equal the torch reference they replace:
RMSNorm, SiLU(gate) * up and RoPE, in bfloat16 and float32, on strided inputs (q/k views of the
fused QKV output) and zero rows. On a GPU the kernels run compiled; elsewhere Triton's interpreter
runs them on CPU tensors; skipped where Triton is not installed (CPU-only torch)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = textwrap.dedent('''
    import os
    import torch
    import torch.nn.functional as F
    from conflux_cluster.engine.models import fused
    from conflux_cluster.engine.models.rope import Rotary
    from conflux_cluster.engine.models.config import ModelConfig
    INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if INTERPRET else "cuda"
    torch.manual_seed(0)

    def ref_norm(x, w, eps):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def ref_rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def close(a, b, dtype, terms=0.0):  # terms: size of the addends where the result is a sum
        # fp32: summation order only; bf16: the same roundings, an fp32 sum in another order may
        # move a value across a rounding boundary (one bf16 ulp: 2^-7 relative), rarely
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if not a.numel():
            return
        af, bf = a.float(), b.float()
        # Triton's interpreter casts fp32 -> bf16 by truncation (compiled kernels round to nearest
        # even, as torch does): up to one ulp per cast there, two casts in a row
        ulps = 2 if INTERPRET else 1
        rel = 1e-5 if dtype == torch.float32 else ulps * 2.0 ** -7
        off = (af - bf).abs() > rel * (bf.abs() + terms) + 1e-6
        assert not off.any(), (af[off][:5], bf[off][:5])
        if dtype != torch.float32 and a.numel() >= 100 and not INTERPRET and not terms:
            assert (af != bf).float().mean().item() < 0.05  # and only a few of them
        # (RoPE's sum of two products: the compiler may keep the products in fp32, i.e. round once
        # where torch rounds three times: within the bound above, but often one ulp apart)

    for dtype in (torch.bfloat16, torch.float32):
        for T in (0, 1, 7, 33):
            n, inter = 96, 80
            x = torch.randn(T, n, device=dev).to(dtype)
            w = (1 + 0.1 * torch.randn(n, device=dev)).to(dtype)
            close(fused.rms_norm(x, w, 1e-6), ref_norm(x, w, 1e-6), dtype)
            wide = torch.randn(T, n + 5, device=dev).to(dtype)[:, :n]  # strided rows
            close(fused.rms_norm(wide, w, 1e-5), ref_norm(wide, w, 1e-5), dtype)
            gu = (3 * torch.randn(T, 2 * inter, device=dev)).to(dtype)
            close(fused.silu_mul(gu, inter), F.silu(gu[:, :inter]) * gu[:, inter:], dtype)
            cfg = ModelConfig(architecture="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=64, head_dim=32)
            rot = Rotary(cfg).to(dev)
            cos, sin = rot.cos_sin(torch.arange(T, device=dev) * 37, dtype)
            qkv = torch.randn(T, (4 + 2 + 2) * 32, device=dev).to(dtype)
            q = qkv[:, :128].view(T, 4, 32)  # a strided view, as the model's q is
            close(fused.rope(q, cos, sin), ref_rope(q, cos, sin), dtype, terms=q.float().abs().max().item() if T else 0.0)
    print("ok")
''')


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def test_fused_kernels_match_torch_reference() -> None:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
