"""The benchmark's model: Llama-3.1-8B dimensions, random weights, plain PyTorch (benchmarks/steps/xp.py).

It mirrors the engine's model (engine/models/transformer.py) without pydantic, which the GPU machine
lacks; attention is the engine's XP attention, passed in as a callable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from conflux_cluster.engine.runtime.cuda_graphs import PiecewiseCudaGraphs, default_buckets
from conflux_cluster.engine.xp.heads import DeviceHeads


PEAK_TFLOPS = 790.0  # bf16 dense GEMM ceiling measured on H200 (DESIGN §6)
HBM_TBPS = 4.3  # device copy ceiling (DESIGN §6)


@dataclass(frozen=True)
class Dims:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    inter: int = 14336
    vocab: int = 128256
    theta: float = 500000.0


@dataclass(frozen=True)
class Sizes:
    """Workload sizes (the issue's numbers; --tiny scales them down for a CPU smoke run)."""

    decodes_per_gpu: int = 24
    decode_ctx: int = 8192
    prefills: tuple[int, ...] = (8192, 32768)  # fig13: injected together (FCFS order)
    long_prefill: int = 32768  # sp_scaling
    roofline_batch: int = 64
    roofline_ctx: int = 4096
    mfu_prompt: int = 8192
    budget_s: float = 0.100
    first_chunk: int = 2048  # per rank, first iteration (then the budget rule)
    min_chunk: int = 128
    block_size: int = 32


TINY_DIMS = Dims(layers=2, hidden=128, heads=8, kv_heads=2, head_dim=16, inter=256, vocab=512, theta=10000.0)
TINY_SIZES = Sizes(decodes_per_gpu=3, decode_ctx=64, prefills=(64, 256), long_prefill=256, roofline_batch=4,
                   roofline_ctx=64, mfu_prompt=128, budget_s=0.05, first_chunk=32, min_chunk=8, block_size=8)


# ---- the model (one device; TP applied by cutting weights at construction) ---------------
class Model:
    """Llama decoder stack with random weights; device shard t of a TP group of ``tp`` devices."""

    def __init__(self, dims: Dims, heads: DeviceHeads, tp_rank: int, tp: int, tp_group, device, dtype,
                 seed: int = 0) -> None:
        self.d, self.heads, self.tp_group = dims, heads, tp_group if tp > 1 else None
        g = torch.Generator(device=device).manual_seed(seed)
        s, hd = heads.tp_shard, dims.head_dim
        base, extra = divmod(dims.inter, tp)
        self.inter = base + (1 if tp_rank < extra else 0)

        def w(*shape):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

        self.embed = w(dims.vocab, dims.hidden)
        self.lm_head = w(dims.vocab, dims.hidden)
        self.layers = []
        for _ in range(dims.layers):
            self.layers.append(dict(
                qkv=w((s.num_q + 2 * s.num_kv) * hd, dims.hidden), o=w(dims.hidden, s.num_q * hd),
                gu=w(2 * self.inter, dims.hidden), down=w(dims.hidden, self.inter),
                n1=torch.ones(dims.hidden, device=device, dtype=dtype),
                n2=torch.ones(dims.hidden, device=device, dtype=dtype)))
        self.inv_freq = 1.0 / (dims.theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        self.graphs: PiecewiseCudaGraphs | None = None  # the active runner (enable_graphs; tp == 1 only)
        self._runners: dict[int, PiecewiseCudaGraphs] = {}  # max_tokens -> captured runner
        self.use_graphs = False

    def enable_graphs(self, max_tokens: int) -> float:
        """Build and capture the piecewise graphs (once); returns the capture seconds."""
        if self.tp_group is not None:
            raise ValueError("CUDA graphs are not used with TP (the all-reduce would be captured)")
        t0 = time.perf_counter()
        if max_tokens not in self._runners:
            dev = self.embed.device
            self._runners[max_tokens] = PiecewiseCudaGraphs(
                self.segments(), lambda b: (torch.zeros(b, dtype=torch.long, device=dev),
                                            torch.zeros(b, dtype=torch.long, device=dev)),
                default_buckets(max_tokens), dev)
            self._runners[max_tokens].capture()
        self.graphs = self._runners[max_tokens]
        self.use_graphs = True
        return time.perf_counter() - t0

    def segments(self) -> list:
        """forward() cut at its attention calls (engine/runtime/cuda_graphs.py contract; carry = x, cos, sin)."""
        hd, s = self.d.head_dim, self.heads.tp_shard

        def qkv(p, x, cos, sin):
            t = x.shape[0]
            q, k, v = F.linear(self._norm(x, p["n1"]), p["qkv"]).split(
                [s.num_q * hd, s.num_kv * hd, s.num_kv * hd], -1)
            return (self._rope(q.view(t, s.num_q, hd), cos, sin), self._rope(k.view(t, s.num_kv, hd), cos, sin),
                    v.view(t, s.num_kv, hd))

        def finish(p, a, x):
            x = x + F.linear(a.reshape(a.shape[0], s.num_q * hd), p["o"])
            gate, up = F.linear(self._norm(x, p["n2"]), p["gu"]).split(self.inter, -1)
            return x + F.linear(F.silu(gate) * up, p["down"])

        def head(ids, pos):
            x = self.embed[ids]
            cos, sin = self._cos_sin(pos, x.dtype)
            return (*qkv(self.layers[0], x, cos, sin), x, cos, sin)

        def middle(i):
            def seg(a, x, cos, sin):
                x = finish(self.layers[i - 1], a, x)
                return (*qkv(self.layers[i], x, cos, sin), x, cos, sin)
            return seg

        def tail(a, x, cos, sin):
            return (finish(self.layers[-1], a, x),)

        return [head, *(middle(i) for i in range(1, len(self.layers))), tail]

    def _cos_sin(self, pos, dtype):
        f = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), -1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def linear_bytes(self) -> int:
        """Bytes of every weight a decode step reads (linears + norms + lm_head)."""
        per = sum(t.numel() * t.element_size() for t in self.layers[0].values())
        return per * len(self.layers) + self.lm_head.numel() * self.lm_head.element_size()

    def linear_params(self) -> int:
        return sum(self.layers[0][k].numel() for k in ("qkv", "o", "gu", "down")) * len(self.layers)

    @staticmethod
    def _norm(x, wt, eps=1e-5):
        xf = x.float()
        return wt * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @staticmethod
    def _rope(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _reduce(self, x):
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    @torch.inference_mode()
    def forward(self, ids, pos, attn, meta, sample_rows):
        # ids, pos: [T]; returns logits [S, V] of sample_rows
        if self.use_graphs:  # shared linears replayed from CUDA graphs, attention eager
            (x,) = self.graphs.run((ids, pos), lambda i, q, k, v: attn(i, q, k, v, meta))
            return F.linear(x[sample_rows], self.lm_head).float()
        hd, s = self.d.head_dim, self.heads.tp_shard
        x = self.embed[ids]  # [T, hidden]
        cos, sin = self._cos_sin(pos, x.dtype)
        t = ids.shape[0]
        for i, p in enumerate(self.layers):
            h = self._norm(x, p["n1"])
            q, k, v = F.linear(h, p["qkv"]).split([s.num_q * hd, s.num_kv * hd, s.num_kv * hd], -1)
            q = self._rope(q.view(t, s.num_q, hd), cos, sin)
            k = self._rope(k.view(t, s.num_kv, hd), cos, sin)
            o = attn(i, q, k, v.view(t, s.num_kv, hd), meta)  # [T, hq, D]
            x = x + self._reduce(F.linear(o.reshape(t, s.num_q * hd), p["o"]))
            h = self._norm(x, p["n2"])
            gate, up = F.linear(h, p["gu"]).split(self.inter, -1)
            x = x + self._reduce(F.linear(F.silu(gate) * up, p["down"]))
        return F.linear(x[sample_rows], self.lm_head).float()


# ---- one XP instance inside the benchmark ------------------------------------------------
