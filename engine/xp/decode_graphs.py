"""Decode-only steps as one CUDA graph per batch size (the whole forward, attention included).

A step whose rows are all local decode tokens (no SP rows, no transition) is the common step of a
loaded server, and the one whose latency is the TBT. Run eagerly, or with piecewise graphs and
eager attention (engine/runtime/cuda_graphs.py), its ~40 launches per layer cost more host time than the
GPU needs for them. Here the whole forward is captured per bucket B (1, 2, 4, ... up to the
rank's decode limit): embed -> L x (norm, qkv, RoPE, KV write, Triton paged decode, o_proj, FFN)
-> final norm. The LM head and sampling stay eager (only sampled rows need logits).

Static inputs, shared by every bucket (views of the largest)::

    ids, pos      [B_max]              token and position of each row
    table         [B_max, max_blocks]  decode block table, wide enough for the longest context
    lengths       [B_max]              keys after this token (padding rows: 0, no attention)
    write_rows    [B_max]              pool row of the new token (padding rows: -1, no write)
    work, count   [capacity], [1]      the paged kernel's split list (triton_decode.decode_work)
    first         [B_max]              each row's first item in it

``capacity``: the pool's tokens in splits plus one partial split per row, and ``min_splits`` per
row where the kernel shortens splits (a step needs more only when requests share prefix-cache
blocks; such a step runs eagerly).

A step of T rows copies its batch into rows [:T], marks rows [T:B] as padding and replays bucket
B. The paged kernel's splits and merge order depend on each request alone, so a request's keys
are summed in the same order as in an eager step (tokens equal; tests/xp/test_triton_decode.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from .kv import DecodeBatch
from .triton_decode import DecodeKernelConfig, DecodeWork

if TYPE_CHECKING:
    from ..models.transformer import CausalLM

log = logging.getLogger(__name__)


class GraphedDecode(Protocol):
    """What the graphs need of the attention backend (``XPAttention`` is one): its pool, its decode
    kernel, the decode path of one layer, and the batch of a decode-only step."""

    kv: Any  # the XPKVCache: decode_tpb, num_kv_heads
    decode_kernel: DecodeKernelConfig  # the Triton decode kernel's launch shape

    def decode_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     batch: DecodeBatch) -> torch.Tensor: ...

    def paged_kernel_ready(self, batch: DecodeBatch) -> bool: ...

    def graph_decode_batch(self) -> DecodeBatch | None: ...


class DecodeGraphs:
    """Captured decode-only forwards of one device; ``run`` returns None where a step does not fit."""

    def __init__(self, model: CausalLM, attention: GraphedDecode, buckets: Sequence[int], max_blocks: int) -> None:
        self.model, self.attention = model, attention
        self.buckets = tuple(sorted(set(buckets)))
        dev = model.embed_tokens.weight.device
        b = self.buckets[-1]
        self.max_blocks = max_blocks
        self.ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(b, dtype=torch.int64, device=dev)
        self.table = torch.zeros(b, max_blocks, dtype=torch.int64, device=dev)
        self.lengths = torch.zeros(b, dtype=torch.int64, device=dev)
        self.rows = torch.full((b,), -1, dtype=torch.int64, device=dev)
        kv, kernel = attention.kv, attention.decode_kernel
        split = kernel.split_len(kv.decode_tpb)
        max_splits = kernel.splits_of(max_blocks * kv.decode_tpb, kv.decode_tpb)  # of one request
        # the pool's keys in full splits, plus per row a partial one and the min_splits short ones
        pool_bound = kv.num_blocks * kv.decode_tpb // split + b * (1 + kernel.min_splits)
        self.capacity = min(b * max_splits, pool_bound)
        self.work = torch.zeros(self.capacity, dtype=torch.int64, device=dev)
        self.work_count = torch.zeros(1, dtype=torch.int64, device=dev)
        self.work_first = torch.zeros(b, dtype=torch.int64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._out: dict[int, torch.Tensor] = {}  # bucket -> static hidden states [B, hidden]
        self._pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # steps that replayed a graph (tests / benchmarks)

    def _batch(self, b: int) -> DecodeBatch:
        programs = self.attention.decode_kernel.programs_for(self.capacity, self.attention.kv.num_kv_heads)
        work = DecodeWork(self.work, self.work_count, self.work_first[:b], self.capacity, programs, self.capacity)
        return DecodeBatch(self.table[:b], self.lengths[:b], self.rows[:b], self.rows[:b], self.max_blocks,
                           write_rows=self.rows[:b], work=work)

    def _forward(self, b: int) -> torch.Tensor:
        batch = self._batch(b)

        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
            return self.attention.decode_layer(layer, q, k, v, batch)

        return self.model.hidden_states(self.ids[:b], self.pos[:b], attn, None)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every bucket (largest first); False (nothing captured) where the paged decode
        kernel does not run on this device, so a step could not be replayed."""
        t0 = time.perf_counter()
        self.lengths[0], self.work_count[0] = 1, 1  # one key of row 0 (item 0 = request 0, split 0)
        self._forward(1)  # eager: compiles the kernels and validates the paged kernel once
        self.lengths[0], self.work_count[0] = 0, 0  # (work[0] and work_first[0] are 0 already)
        if not self.attention.paged_kernel_ready(self._batch(1)):
            log.warning("decode CUDA graphs off: the Triton paged decode kernel does not run here")
            return False
        side = torch.cuda.Stream(device=self.ids.device)
        for b in sorted(self.buckets, reverse=True):
            side.wait_stream(torch.cuda.current_stream(self.ids.device))
            with torch.cuda.stream(side):  # one eager pass first: no lazy initialisation inside a capture
                self._forward(b)
            torch.cuda.current_stream(self.ids.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                self._out[b] = self._forward(b)
            self._graphs[b] = g
        torch.cuda.synchronize(self.ids.device)
        log.info("captured decode CUDA graphs of %d batch sizes (up to %d requests, %d-block tables) in %.2f s",
                 len(self._graphs), self.buckets[-1], self.max_blocks, time.perf_counter() - t0)
        return True

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Hidden states [T, hidden] of a decode-only step (this step's batch comes from the
        attention backend), or None: not decode-only, too many rows, or a table too wide."""
        batch = self.attention.graph_decode_batch()
        t = input_ids.shape[0]
        b = next((x for x in self.buckets if x >= t), None)
        if batch is None or b is None or b not in self._graphs or batch.max_blocks > self.max_blocks \
                or batch.work.num_items > self.capacity:
            return None
        self.ids[:t].copy_(input_ids)
        self.pos[:t].copy_(positions)
        self.table[:t, :batch.max_blocks].copy_(batch.table)
        self.lengths[:t].copy_(batch.lengths)
        self.rows[:t].copy_(batch.write_rows)
        self.work[:batch.work.num_items].copy_(batch.work.items[:batch.work.num_items])
        self.work_count.copy_(batch.work.count)
        self.work_first[:t].copy_(batch.work.first)
        if b > t:  # padding rows: no keys, no write
            self.lengths[t:b].zero_()
            self.rows[t:b].fill_(-1)
        self._graphs[b].replay()
        self.replays += 1
        return self._out[b][:t]
