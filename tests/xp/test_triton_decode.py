"""The Triton paged decode kernel equals the torch gather path (Triton's interpreter on CPU;
skipped where Triton is not installed, e.g. CPU-only torch)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

CHECK = textwrap.dedent('''
    import torch
    from conflux_cluster.engine.xp import triton_decode as td
    from conflux_cluster.engine.xp.ops import decode_attention
    import os
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    torch.set_default_device(dev)
    torch.manual_seed(0)
    B, hq, hkv, D, bs, NB = 3, 8, 2, 16, 16, 20
    pool_k, pool_v = torch.randn(NB, bs * hkv * D + 7), torch.randn(NB, bs * hkv * D + 7)  # aliased rows
    kv = pool_k[:, : bs * hkv * D].view(NB, bs, hkv, D)
    vv = pool_v[:, : bs * hkv * D].view(NB, bs, hkv, D)
    lens = torch.tensor([5, 40, 33])
    table = torch.tensor([[3, 0, 0], [7, 1, 12], [19, 4, 2]])
    q = torch.randn(B, hq, D)
    kp, vp = kv[table].reshape(B, 3 * bs, hkv, D), vv[table].reshape(B, 3 * bs, hkv, D)
    ref = decode_attention(q, kp, vp, lens, [i // (hq // hkv) for i in range(hq)], D ** -0.5)
    # one tile per program (many splits), tiles of several pool blocks, one split per request
    for cfg in (td.DecodeKernelConfig(16, 16), td.DecodeKernelConfig(32, 32), td.DecodeKernelConfig(64, 1024)):
        out = td.paged_decode_attention(q, kv, vv, table, lens, D ** -0.5, 3, cfg)
        err = (out - ref).abs().max().item()
        assert err < 1e-4, (cfg, err)
    print("ok", err)
''')


def test_paged_decode_kernel_matches_torch() -> None:
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "0" if _has_cuda() else "1")
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
