"""Piecewise CUDA graphs for the shared-linear segments of a decoder (vLLM-style).

A forward pass of an L-layer decoder is cut at its attention calls into L + 1 *segments*::

    seg 0      : embed, RoPE tables, layer 0's norm + qkv_proj (+ q/k norm, RoPE)   -> q, k, v, carry
    attn(0)    : EAGER (collectives, per-step metadata, paged KV)
    seg j      : layer j-1's o_proj + residual + norm + FFN + residual,
                 layer j's norm + qkv_proj (+ q/k norm, RoPE)                       -> q, k, v, carry
    attn(j)    : EAGER
    seg L      : layer L-1's o_proj + FFN, final norm                               -> outputs

Every segment is row-wise (row i of an output depends on row i of the inputs only), so a batch of
``T`` tokens can be padded up to a *bucket* ``B >= T`` (1, 2, 4, ... 256, steps of 128 to 1024, then of ~1/4) and
run by replaying graphs captured once per (segment, bucket). Attention only ever sees the ``T``
real rows. Token counts above the largest bucket run the same segment functions eagerly.

Segment contract (``PiecewiseCudaGraphs(segments, ...)``)::

    segments[0](*head_inputs)       -> (q, k, v, *carry)     head_inputs: tensors [T, ...]
    segments[j](a, *carry)          -> (q, k, v, *carry)     1 <= j < L; a = attention output
    segments[L](a, *carry)          -> tuple of outputs      a: same shape/dtype as q
    every tensor's dim 0 is the token axis; segments must not modify their inputs in place

Static buffers: per bucket, seg j's carry inputs ARE seg j-1's captured carry outputs (no copy);
only the head inputs and each attention output are copied into static buffers before a replay.
All graphs share one memory pool (replays are serial on one stream; every static input/output is
kept alive, so temporaries are the only shared memory). Outputs returned by ``run`` are views of
static buffers: valid until the next ``run`` of the same bucket.

Use with the engine's model: ``GraphedCausalLM(model)`` (``EngineConfig.cuda_graphs``); CUDA only,
and not with base TP (the all-reduce hooks would be captured; left eager). ``GraphedCausalLM``
captures every bucket when it is built (``capture_all``), so no request pays a capture: a rank
worker builds it after its KV pool, before the instance reports ready. Capture needs no attention:
each segment is captured on its own, with a zero tensor standing in for the attention output.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:  # the generic runner imports no model code (benchmarks load it without pydantic)
    from ..models.transformer import CausalLM, DecoderLayer

log = logging.getLogger(__name__)

Segment = Callable[..., tuple]
AttentionCall = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_buckets(max_tokens: int = 1024) -> tuple[int, ...]:
    """Powers of two up to 256, steps of 128 up to 1024, then steps of ~25 % rounded to 256.

    A step pays the GEMMs of its bucket: with powers of two up to 512 a 264-token step ran the
    shared linear layers as 512 tokens, and a step of 520 tokens ran them eagerly at ~9 ms more
    (one H200, Llama-3.1-8B); served chunks over long histories land in 250-600 tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, b = [], 1
    while b <= min(max_tokens, 256):
        out.append(b)
        b *= 2
    b = 256
    while b + 128 <= min(max_tokens, 1024):
        b += 128
        out.append(b)
    while True:
        b = max(b + 256, int(b * 1.25) // 256 * 256)
        if b > max_tokens:
            break
        out.append(b)
    if out[-1] != max_tokens:
        out.append(max_tokens)
    return tuple(out)


class _Bucket:
    """Captured graphs and static buffers of one bucket size."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.head_in: tuple[torch.Tensor, ...] = ()
        self.attn_in: list[torch.Tensor] = []  # [L] static attention outputs, [B, Hq, D]
        self.outs: list[tuple[torch.Tensor, ...]] = []  # [L + 1] static outputs of each segment
        self.graphs: list[torch.cuda.CUDAGraph] = []


class PiecewiseCudaGraphs:
    """Runs ``segments`` with eager attention in between; replays CUDA graphs for bucketed sizes.

    ``enabled=False`` (or a CPU device) runs every segment eagerly: same math, no graphs.
    """

    def __init__(self, segments: Sequence[Segment], head_example: Callable[[int], tuple[torch.Tensor, ...]],
                 buckets: Sequence[int] = default_buckets(), device: torch.device | None = None,
                 enabled: bool = True) -> None:
        """``head_example(B)``: valid head inputs for B tokens (e.g. zero ids and positions)."""
        if len(segments) < 2:
            raise ValueError("need at least a head and a tail segment")
        self.segments = list(segments)
        self.head_example = head_example
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive token counts, got {buckets}")
        self.device = device
        self.enabled = enabled and device is not None and device.type == "cuda"
        self._captured: dict[int, _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self.replays = 0  # forwards that replayed graphs (tests / benchmarks)
        self.eager_runs = 0  # forwards that ran eagerly (no bucket, or disabled)

    @property
    def num_layers(self) -> int:
        return len(self.segments) - 1

    @property
    def captured(self) -> tuple[int, ...]:
        """Bucket sizes whose graphs exist, ascending."""
        return tuple(sorted(self._captured))

    def bucket(self, num_tokens: int) -> int | None:
        """Smallest bucket >= num_tokens, or None (eager) when graphs are off or T is too large."""
        if not self.enabled:
            return None
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    # ---- capture -------------------------------------------------------------------------
    def capture(self, sizes: Sequence[int] | None = None) -> None:
        """Capture every bucket in ``sizes`` (default: all), largest first (smaller ones then reuse
        the pool's temporaries). Call while no collective or side-stream work is in flight."""
        if not self.enabled:
            return
        for b in sorted(sizes or self.buckets, reverse=True):
            if b not in self._captured:
                self._captured[b] = self._capture_one(b)

    @torch.inference_mode()
    def _capture_one(self, size: int) -> _Bucket:
        bk = _Bucket(size)
        bk.head_in = tuple(t.clone() for t in self.head_example(size))
        self._warm_up(bk.head_in)
        for j, seg in enumerate(self.segments):
            if j == 0:
                args = bk.head_in
            else:
                prev = bk.outs[-1]
                bk.attn_in.append(torch.zeros_like(prev[0]))  # attention output: q's shape
                args = (bk.attn_in[-1], *prev[3:])
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                outs = tuple(seg(*args))
            bk.graphs.append(g)
            bk.outs.append(outs)
        return bk

    def _warm_up(self, head_in: tuple[torch.Tensor, ...]) -> None:
        """One eager pass on a side stream (lazy library init must not happen inside a capture)."""
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            outs = self.segments[0](*head_in)
            for seg in self.segments[1:]:
                outs = seg(torch.zeros_like(outs[0]), *outs[3:])
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)

    # ---- run -----------------------------------------------------------------------------
    @torch.inference_mode()  # static buffers are inference tensors
    def run(self, head_inputs: Sequence[torch.Tensor], attention: AttentionCall) -> tuple[torch.Tensor, ...]:
        """One forward of ``T = head_inputs[0].shape[0]`` tokens; ``attention(j, q, k, v)`` sees the
        T real rows. Returns the last segment's outputs, rows [:T]."""
        t = head_inputs[0].shape[0]
        b = self.bucket(t)
        if b is None:
            self.eager_runs += 1
            return self._run_eager(head_inputs, attention)
        if b not in self._captured:
            self.capture([b])
        bk = self._captured[b]
        self.replays += 1
        for dst, src in zip(bk.head_in, head_inputs):
            dst[:t].copy_(src)
        for j, g in enumerate(bk.graphs):
            if j > 0:
                q, k, v = (x[:t] for x in bk.outs[j - 1][:3])
                bk.attn_in[j - 1][:t].copy_(attention(j - 1, q, k, v))
            g.replay()
        return tuple(x[:t] for x in bk.outs[-1])

    def _run_eager(self, head_inputs: Sequence[torch.Tensor], attention: AttentionCall) -> tuple[torch.Tensor, ...]:
        outs = self.segments[0](*head_inputs)
        for j, seg in enumerate(self.segments[1:]):
            outs = seg(attention(j, *outs[:3]), *outs[3:])
        return tuple(outs)


# ---- the engine's model -----------------------------------------------------------------
def _qkv(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """Layer's input norm + fused qkv_proj + q/k norm + RoPE (as ``Attention.forward``)."""
    from ..models.rope import apply_rotary

    a = layer.self_attn
    t = x.shape[0]
    q, k, v = a.qkv_proj(layer.input_layernorm(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    q = q.view(t, a.num_heads, a.head_dim)  # [T, Hq, D]
    k = k.view(t, a.num_kv, a.head_dim)  # [T, Hkv, D]
    v = v.view(t, a.num_kv, a.head_dim)
    if a.q_norm is not None:
        q, k = a.q_norm(q), a.k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _finish(layer: DecoderLayer, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Layer's o_proj + residual + post-attention norm + FFN + residual."""
    x = x + layer.self_attn.o_proj(a.reshape(a.shape[0], layer.self_attn.q_size))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def causal_lm_segments(model: CausalLM) -> list[Segment]:
    """The L + 1 segments of ``CausalLM.hidden_states`` (carry = residual x, cos, sin)."""
    layers = list(model.layers)

    def head(ids: torch.Tensor, pos: torch.Tensor) -> tuple:
        x = model.embed_tokens(ids)  # [T, hidden]
        cos, sin = model.rotary.cos_sin(pos, x.dtype)  # [T, 1, D]
        return (*_qkv(layers[0], x, cos, sin), x, cos, sin)

    def middle(j: int) -> Segment:
        def seg(a: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
            x = _finish(layers[j - 1], a, x)
            return (*_qkv(layers[j], x, cos, sin), x, cos, sin)
        return seg

    def tail(a: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        return (model.norm(_finish(layers[-1], a, x)),)

    return [head, *(middle(j) for j in range(1, len(layers))), tail]


class GraphedCausalLM:
    """``CausalLM.forward`` with piecewise CUDA graphs; the LM head runs eagerly on sampled rows only."""

    def __init__(self, model: CausalLM, buckets: Sequence[int] = default_buckets(),
                 enabled: bool = True, capture_now: bool = True) -> None:
        """``capture_now``: capture every bucket here (``capture_all``); False: each bucket at its first use."""
        self.model = model
        dev = model.embed_tokens.weight.device

        def head_example(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            z = torch.zeros(b, dtype=torch.int64, device=dev)
            return z, z.clone()

        self.graphs = PiecewiseCudaGraphs(causal_lm_segments(model), head_example, buckets, dev, enabled)
        self.capture_s = self.capture_all() if capture_now else 0.0  # seconds the capture at build took

    def capture_all(self) -> float:
        """Capture the graphs of every bucket now; returns the seconds it took (0.0 with graphs off)."""
        g = self.graphs
        if not g.enabled:
            return 0.0
        t0 = time.perf_counter()
        g.capture()
        torch.cuda.synchronize(g.device)
        dt = time.perf_counter() - t0
        log.info("captured CUDA graphs of %d buckets (%s tokens) x %d segments in %.2f s",
                 len(g.captured), ",".join(map(str, g.captured)), len(g.segments), dt)
        return dt

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, meta,
                 sample_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``CausalLM.forward``: float32 logits [S, vocab]."""
        (h,) = self.graphs.run((input_ids, positions), lambda j, q, k, v: attn(j, q, k, v, meta))
        return self.model.logits(h if sample_rows is None else h[sample_rows])
