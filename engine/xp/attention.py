"""XP attention: the model's attention seam ``attn(layer_idx, q, k, v, meta)`` across N ranks.

Per layer, on every device (paper Fig. 7)::

    q/k/v [T_local, h, D]  =  [ SP tokens (prefill) | local decode tokens ]
      SP part  -> all-to-all: seq-sharded, all heads -> all SP tokens, this device's head sub-shard
               -> per request: append chunk KV to the head-sharded prefill view, causal attention
                  over history + chunk
               -> all-to-all back: own tokens, all heads
      decode   -> append to the decode view, attention over the request's own KV (no comm)
      transitions (final chunk ran): head shards of the prompt KV -> decode rank (this layer);
                with one SP rank the prefill table simply becomes the decode table (no copy)

On CUDA the decode path runs on its own stream, concurrent with the SP path (mode ``xp``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import torch

from .comm import XPGroups, all_to_all_flat, all_to_all_packed
from .heads import DeviceHeads
from .decode_graphs import DecodeGraphs
from .kv import DecodeBatch, XPKVCache
from ..runtime.cuda_graphs import default_buckets
from ..contracts.step import StepPlan
from ..kv.prefix_blocks import insert_on_rank
from ..util.transfer import tensor_to_device
from .meta import XPStepMeta, build_step_meta
from .modes import XPMode
from . import split_history
from .ops import causal_attention, decode_attention, prepare_history_attention
from .prefix_load import load_prefixes
from . import paged_prefill
from .thread_warm import PerThreadWarm
from .triton_decode import DecodeKernelConfig, decode_work, paged_decode_attention
from .triton_decode import available as triton_available


class XPAttention:
    """Implements the attention seam for one device; owns nothing but references."""

    def __init__(self, heads: DeviceHeads, kv: XPKVCache, groups: XPGroups, scale: float,
                 mode: XPMode = XPMode.XP, decode_sms: int | None = None,
                 decode_kernel: DecodeKernelConfig = DecodeKernelConfig(), max_history: int = 0) -> None:
        """``decode_sms``: run the decode stream in a ``torch.cuda.GreenContext`` of that many SMs
        (paper §6.1 SM partitioning; experimental, CUDA only, falls back to a plain stream).
        ``decode_kernel``: tile sizes of the Triton paged decode kernel. ``max_history``: the longest
        context a chunk can attend to (the split-history path prepares its kernels up to it)."""
        self.decode_sms, self.decode_kernel = decode_sms, decode_kernel
        self.heads, self.kv, self.groups, self.scale, self.mode = heads, kv, groups, scale, mode
        self._decode_stream = None
        self._meta: XPStepMeta | None = None
        self._dec_batch = None  # DecodeBatch of the current step (local decodes)
        self._sp_dec_batch = None  # DecodeBatch of single-token SP segments (uniform-sp decodes)
        self._sp_dec_idx = None  # their rows in the received SP token array
        self._pending = None  # in-flight transition all-to-all of the previous layer
        self._seg_addr: list = []  # per chunk segment: (seg, (rows, write blocks, offsets, read blocks))
        self._gather_blocks: dict[str, torch.Tensor] = {}  # transition request -> its prefill blocks
        self._decode_slots: dict[str, tuple] = {}  # transition request -> (blocks, offsets, rows) it fills
        # one SP rank holds every kv head: its SP rows are attended in place (nothing to exchange) and at a
        # transition the prefill table becomes the decode table (``XPKVCache.hand_over``: no gather)
        self._one_sp_rank = groups.num_ranks == 1
        # Triton paged decode on CUDA: None = not yet validated, False = off (XP_DECODE_KERNEL=torch)
        self._use_kernel: bool | None = False if os.environ.get("XP_DECODE_KERNEL") == "torch" else None
        self._force_kernel = os.environ.get("XP_DECODE_KERNEL") == "force"
        tp = heads.tp_shard
        self._dec_kv_of_q = [hq // heads.group - tp.kv_lo for hq in range(tp.q_lo, tp.q_hi)]
        self.set_mode(mode)
        # the split-history partitions, tuned on this device (and its kernels loaded) before the first request
        longest = min(max_history, kv.num_blocks * kv.prefill_tpb)  # no history outgrows this rank's pool
        kv_of_sp = heads.kv_of_q(heads.sp_shard)
        self._split = (prepare_history_attention(kv_of_sp, kv.head_dim, kv.k.dtype, kv.k.device, longest)
                       if kv.k.is_cuda and heads.sp_shard.num_q else None)
        # cuDNN's plans live in a per-thread cache: built again on the thread that runs the steps (thread_warm.py)
        self._plans = PerThreadWarm(lambda: split_history.warm_cudnn(
            self._split, kv_of_sp, kv.head_dim, kv.k.dtype, kv.k.device, longest)) \
            if self._split is not None and self._split.cudnn else None
        # all of a step's chunks in one paged call per layer (FlashInfer, CUDA): None = not yet validated,
        # False = off (XP_PREFILL_KERNEL=torch, not installed, or irregular GQA shards)
        self._kv_of_sp = kv_of_sp
        self._prefill_kernel = self._make_paged_prefill(kv_of_sp)
        self._use_prefill_kernel: bool | None = None if self._prefill_kernel is not None else False
        self._chunk_write = None  # this step's (rows of the received array, blocks, offsets, pool rows)

    def set_mode(self, mode: XPMode) -> None:
        """``xp`` overlaps decode attention on a side CUDA stream; other modes run it in line."""
        self.mode = mode
        self._decode_stream, self._green = None, None
        if self.kv.k.is_cuda and mode == XPMode.XP:
            self._decode_stream, self._green = _decode_stream(self.kv.k.device, self.decode_sms)

    # ---- RankWorker hooks (plan-level step bracket; see engine/runtime/worker.py) ----------------
    manages_kv = True  # the worker must not allocate KV itself: prefill KV is head-sharded

    def begin_plan(self, plan: StepPlan) -> None:
        """Build this step's metadata from the plan, free finished requests, reserve KV."""
        sp_pos = None
        if self.mode == XPMode.UNIFORM_SP:
            sp_pos = {rid: self.kv.prefill_len(rid) for ids in plan.decode for rid in ids}
        self._meta = build_step_meta(plan, self.groups.rank, self.mode == XPMode.UNIFORM_SP, sp_pos)
        self.begin_step(self._meta)

    def needs_forward(self) -> bool:
        """Run the model even with no local rows: this device must join the step's collectives."""
        m = self._meta
        return m.has_sp or bool(m.transitions) or bool(m.local_decode)

    def prepare(self, spans, num_tokens: int) -> XPStepMeta:
        """AttentionBackend API: the metadata of ``begin_plan`` (spans follow the same row order)."""
        if sum(sp.num_rows for sp in spans) != num_tokens or self._meta is None:
            raise RuntimeError("XPAttention.prepare without begin_plan, or rows do not match")
        return self._meta

    def end_plan(self, plan: StepPlan) -> None:
        self.end_step(self._meta)
        self._meta = None

    def check_invariants(self, live_requests: set[str] | None = None) -> None:
        self.kv.check_invariants(live_requests)

    # ---- step bracket ------------------------------------------------------------------
    def begin_step(self, meta: XPStepMeta) -> None:
        """Cache finished requests' retained blocks, free finished requests and evicted cached blocks, load
        prefix hits, and reserve blocks for everything this step writes."""
        if self._plans is not None:
            self._plans.ensure()
        insert_on_rank(self.kv, meta.retained, self.groups.rank)  # before their tables go
        for rid in meta.finished:
            self.kv.free(rid)
        self.kv.evict(meta.evicted)
        if meta.prefix_hits:
            load_prefixes(self.kv, self.heads, self.groups, meta.prefix_hits)
        for seg in meta.sp_segments:
            self.kv.reserve_prefill(seg.request_id, seg.end)
        for rid in meta.local_decode:
            self.kv.reserve_decode(rid, self.kv.decode_len(rid) + 1)
        for t in meta.transitions:
            if t.decode_rank == self.groups.rank and not self._one_sp_rank:
                self.kv.reserve_decode(t.request_id, t.prompt_len)
        self._dec_batch = self._with_work(self.kv.decode_batch(meta.local_decode)) if meta.local_decode else None
        self._address(meta)

    def _address(self, meta: XPStepMeta) -> None:
        """Device-side indices for the whole step, built once (per-layer host->device copies would
        synchronize the stream at every layer)."""
        dev = self.kv.k.device
        single = [seg for seg in meta.sp_segments if seg.end - seg.start == 1 and seg.start > 0]
        chunks = [seg for seg in meta.sp_segments if not (seg.end - seg.start == 1 and seg.start > 0)]
        self._sp_dec_batch = self._with_work(self.kv.decode_batch([s.request_id for s in single], prefill=True)) \
            if single else None
        self._sp_dec_idx = tensor_to_device(torch.cat([s.token_idx for s in single]), dev) if single else None
        self._seg_addr = []
        self._chunk_write = None
        if chunks and self._use_prefill_kernel is not False:
            self._plan_chunks(chunks)
        if self._use_prefill_kernel is True:
            chunks = []  # per-segment addresses only for the torch path (and the kernel's validation)
        for seg in chunks:
            wb, wo = self.kv.slots(seg.request_id, seg.start, seg.end, True)
            self._seg_addr.append((seg, (_rows_of(seg.token_idx, dev), wb, wo, self.kv.rows(wb, wo, True),
                                         self.kv.block_ids(seg.request_id, seg.end, True))))
        moving = [] if self._one_sp_rank else meta.transitions
        self._gather_blocks = {t.request_id: self.kv.block_ids(t.request_id, t.prompt_len, True) for t in moving}
        self._decode_slots = {}
        for t in moving:
            if t.decode_rank == self.groups.rank:
                wb, wo = self.kv.slots(t.request_id, t.start, t.prompt_len, False)
                self._decode_slots[t.request_id] = (wb, wo, self.kv.rows(wb, wo, False))

    @property
    def prefill_kernel(self) -> str:
        """Which path attends this device's chunks: "flashinfer" or "torch"."""
        return "flashinfer" if self._prefill_kernel is not None and self._use_prefill_kernel is not False else "torch"

    def set_prefill_kernel(self, enabled: bool) -> None:
        """Benchmarks: switch the paged prefill kernel off (the torch path) or back on where it exists."""
        if self._prefill_kernel is not None:
            self._use_prefill_kernel = True if enabled else False

    def set_prefill_backend(self, backend: str) -> str:
        """Benchmarks: rebuild the paged prefill kernel with FlashInfer's ``backend`` ("auto", "fa2",
        "fa3"); returns the kernel's backend name, "torch" where the kernel does not run here."""
        if self._prefill_kernel is None:
            return "torch"
        self._prefill_kernel = self._make_paged_prefill(self._kv_of_sp, backend)
        return self._prefill_kernel.backend if self._prefill_kernel is not None else "torch"

    @property
    def prefill_backend(self) -> str:
        """FlashInfer's kernel family of the paged prefill ("fa2", "fa3"; "auto" before its first plan)."""
        return self._prefill_kernel.backend if self._prefill_kernel is not None else "torch"

    def _make_paged_prefill(self, kv_of_sp: list[int], backend: str = "auto"):
        """The FlashInfer path where it runs: CUDA, installed, plain GQA over this device's SP heads."""
        kv = self.kv
        if not kv.k.is_cuda or os.environ.get("XP_PREFILL_KERNEL") == "torch" or not paged_prefill.available():
            return None
        if kv.k.dtype not in (torch.float16, torch.bfloat16):  # FlashInfer's prefill kernels: 16-bit only
            return None
        hkv = kv.prefill_kv_heads
        if not kv_of_sp or len(kv_of_sp) % hkv or kv_of_sp != [i // (len(kv_of_sp) // hkv) for i in range(len(kv_of_sp))]:
            return None
        try:
            return paged_prefill.PagedPrefill(kv.k.device, len(kv_of_sp), hkv, kv.head_dim, kv.prefill_tpb,
                                              kv.k.dtype, self.scale, backend)
        except Exception as e:  # noqa: BLE001 - an install that imports but cannot build its kernels
            warnings.warn(f"FlashInfer paged prefill unavailable ({e!r}); chunks use the torch path")
            return None

    def _plan_chunks(self, chunks: list) -> None:
        """One FlashInfer plan and one KV write address list for all of this step's chunks."""
        kv, dev = self.kv, self.kv.k.device
        tables = [kv.host_block_ids(seg.request_id, seg.end, True) for seg in chunks]
        packed = paged_prefill.pack_segments(chunks, tables, kv.prefill_tpb)
        try:
            self._prefill_kernel.plan(packed)
        except Exception as e:  # noqa: BLE001 - first use only: a kernel that cannot build here falls back
            if self._use_prefill_kernel:
                raise
            warnings.warn(f"FlashInfer paged prefill failed to plan ({e!r}); chunks use the torch path")
            self._use_prefill_kernel = False
            return
        host = [kv.host_slots(seg.request_id, seg.start, seg.end, True) for seg in chunks]
        wb = tensor_to_device(torch.cat([b for b, _ in host]), dev)
        wo = tensor_to_device(torch.cat([o for _, o in host]), dev)
        n = packed.qo_indptr[-1]
        rows = slice(0, n) if packed.perm is None else tensor_to_device(torch.tensor(packed.perm), dev)
        self._chunk_write = (rows, wb, wo, kv.rows(wb, wo, True))

    def end_step(self, meta: XPStepMeta) -> None:
        """Advance table lengths; drop the prefill shards of requests that moved to decode."""
        self._finish_gather()
        if self._chunk_write is not None and self._use_prefill_kernel is not False:
            self._prefill_kernel.end_step()  # its plan buffers are free once what is queued now has run
        for seg in meta.sp_segments:
            self.kv.advance(seg.request_id, seg.end, prefill=True)
        for rid in meta.local_decode:
            self.kv.advance(rid, self.kv.decode_len(rid) + 1, prefill=False)
        for t in meta.transitions:
            if self._one_sp_rank:
                self.kv.hand_over(t.request_id, t.prompt_len)
                continue
            if t.decode_rank == self.groups.rank:
                self.kv.advance(t.request_id, t.prompt_len, prefill=False)
            self.kv.free_prefill(t.request_id)
        insert_on_rank(self.kv, meta.cache_inserts, self.groups.rank)

    # ---- the seam ----------------------------------------------------------------------
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: XPStepMeta) -> torch.Tensor:
        """q [T, hq, D], k/v [T, hkv, D] (device-local heads, RoPE applied) -> o [T, hq, D]."""
        self._finish_gather()  # previous layer's transition KV (overlapped with this layer's QKV GEMM)
        n_sp = meta.num_local_sp
        out = torch.empty_like(q)
        side = self._decode_stream if meta.local_decode else None
        # the first all-to-all is issued before the decode kernels: in xp (async) decode attention
        # runs on the side stream while tokens cross NVLink; otherwise the two run one after the other
        sent = self._sp_send(q[:n_sp], k[:n_sp], v[:n_sp], meta, async_op=side is not None) \
            if meta.has_sp and not self._one_sp_rank else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(q.device))
            with torch.cuda.stream(side):
                out[n_sp:] = self._decode(layer, q[n_sp:], k[n_sp:], v[n_sp:], meta)
        elif meta.local_decode:
            out[n_sp:] = self._decode(layer, q[n_sp:], k[n_sp:], v[n_sp:], meta)
        if sent is not None:
            out[:n_sp] = self._sp_finish(layer, sent, n_sp, q.dtype, meta)
        elif meta.has_sp:
            self._sp_attend(layer, q[:n_sp], k[:n_sp], v[:n_sp], out[:n_sp])
        if meta.transitions and not self._one_sp_rank:
            self._gather(layer, meta)
        if side is not None:
            torch.cuda.current_stream(q.device).wait_stream(side)
        return out

    # ---- SP (prefill) path -------------------------------------------------------------
    def _sp_send(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: XPStepMeta,
                 async_op: bool) -> tuple:
        """Pack this device's SP rows per destination into one buffer and start the all-to-all:
        destination p gets ``[n_local, hq_p + 2 hkv_p, D]`` (its q, k, v heads of my tokens)."""
        h, d = self.heads, q.shape[-1]
        n_local = q.shape[0]
        widths = [s.num_q + 2 * s.num_kv for s in h.sp_shards]
        buf = q.new_empty(n_local * sum(widths) * d)
        off = 0
        for shard, w in zip(h.sp_shards, widths):
            view = buf[off:off + n_local * w * d].view(n_local, w, d)
            qs, ks, nq, nk = h.q_slice(shard), h.kv_slice(shard), shard.num_q, shard.num_kv
            view[:, :nq] = q[:, qs]
            view[:, nq:nq + nk] = k[:, ks]
            view[:, nq + nk:] = v[:, ks]
            off += n_local * w * d
        me = h.sp_shard
        width = me.num_q + 2 * me.num_kv
        recv = all_to_all_packed(buf, [n_local * w * d for w in widths], [c * width * d for c in meta.sp_counts],
                                 self.groups.sp, async_op)
        return (recv if async_op else (lambda: recv)), buf  # buf stays referenced until the transfer is done

    def _sp_finish(self, layer: int, sent: tuple, n_local: int, dtype: torch.dtype,
                   meta: XPStepMeta) -> torch.Tensor:
        """Attention over this device's head sub-shard for all SP tokens, then all-to-all back."""
        h, d = self.heads, self.kv.head_dim
        me = h.sp_shard
        width = me.num_q + 2 * me.num_kv
        x = sent[0]().view(-1, width, d)  # [T_sp_total, hq_me + 2 hkv_me, D], grouped by source rank
        qx, kx, vx = x.split([me.num_q, me.num_kv, me.num_kv], dim=1)
        ox = qx.new_empty(qx.shape)  # [T_sp_total, hq_me, D], contiguous (packed for the way back)
        self._sp_attend(layer, qx, kx, vx, ox)
        # rows of ox are grouped by source rank: the flat ox is already packed per destination
        got = all_to_all_packed(ox.reshape(-1), [c * me.num_q * d for c in meta.sp_counts],
                                [n_local * s.num_q * d for s in h.sp_shards], self.groups.sp)
        out = torch.empty(n_local, h.tp_shard.num_q, d, dtype=dtype, device=x.device)
        off = 0
        for shard in h.sp_shards:
            out[:, h.q_slice(shard)] = got[off:off + n_local * shard.num_q * d].view(n_local, shard.num_q, d)
            off += n_local * shard.num_q * d
        return out

    def _sp_attend(self, layer: int, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor,
                   ox: torch.Tensor) -> None:
        """ox [T_sp, hq_me, D] = attention of every SP token over its request's head-sharded KV
        (qx/kx/vx: all SP tokens for this device's head sub-shard, in received order)."""
        kv_of_q = self.heads.kv_of_q(self.heads.sp_shard)
        if self._sp_dec_batch is not None:  # uniform-sp decode tokens: one batched paged call
            idx = self._sp_dec_idx
            self.kv.write_decode(layer, self._sp_dec_batch, kx[idx], vx[idx])
            ox[idx] = self._paged(layer, qx[idx], self._sp_dec_batch, kv_of_q).to(ox.dtype)
        if self._chunk_write is not None and self._use_prefill_kernel is not False:
            self._attend_chunks_paged(layer, qx, kx, vx, ox, kv_of_q)
            return
        for seg, (idx, wb, wo, rows, rb) in self._seg_addr:  # chunks: history + chunk, causal
            self.kv.write_at(layer, wb, wo, kx[idx], vx[idx], prefill=True, rows=rows)
            kk, vv = self.kv.read_at(layer, rb, seg.end, prefill=True)
            ox[idx] = causal_attention(qx[idx], kk.to(qx.dtype), vv.to(qx.dtype), seg.start,
                                       kv_of_q, self.scale, table=self._split).to(ox.dtype)

    def _attend_chunks_paged(self, layer: int, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor,
                             ox: torch.Tensor, kv_of_q: list[int]) -> None:
        """Every chunk of the step: one KV write and one FlashInfer call over the paged history."""
        idx, wb, wo, rows = self._chunk_write
        self.kv.write_at(layer, wb, wo, kx[idx], vx[idx], prefill=True, rows=rows)
        kp, vp = self.kv.decode_views(layer, prefill=True)
        self._prefill_kernel.run(qx, kp, vp, ox)
        if self._use_prefill_kernel is None:  # first use: validate against the torch path once
            refs = []
            for seg, (sidx, _, _, _, rb) in self._seg_addr:
                kk, vv = self.kv.read_at(layer, rb, seg.end, prefill=True)
                refs.append((sidx, causal_attention(qx[sidx], kk.to(qx.dtype), vv.to(qx.dtype), seg.start,
                                                    kv_of_q, self.scale)))
            # relative to the output's scale: bf16 rounds values of several units by more than 2e-2
            err = max(((ox[i].float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1.0)).item()
                      for i, r in refs)
            self._use_prefill_kernel = err < 2e-2
            if not self._use_prefill_kernel:
                warnings.warn(f"FlashInfer paged prefill differs from torch by {err:.3g}: using torch")
                for i, r in refs:
                    ox[i] = r.to(ox.dtype)

    # ---- local decode path -------------------------------------------------------------
    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: XPStepMeta) -> torch.Tensor:
        return self.decode_layer(layer, q, k, v, self._dec_batch)

    def decode_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     batch: DecodeBatch) -> torch.Tensor:
        """q [B, hq, D], k/v [B, hkv, D]: one new token per request of ``batch`` (decode view)."""
        self.kv.write_decode(layer, batch, k, v)
        return self._paged(layer, q, batch, self._dec_kv_of_q)

    # ---- decode-only steps as CUDA graphs (decode_graphs.py) ---------------------------
    def capture_decode_graphs(self, model, max_batch: int, max_context: int) -> DecodeGraphs | None:
        """Whole-forward graphs of decode-only steps of up to ``max_batch`` requests of up to
        ``max_context`` tokens (CUDA, mode xp or xp-no-overlap); None where they cannot run."""
        if not self.kv.k.is_cuda or self.mode == XPMode.UNIFORM_SP:
            return None
        max_blocks = min(-(-max_context // self.kv.decode_tpb), self.kv.num_blocks)
        graphs = DecodeGraphs(model, self, default_buckets(max_batch), max_blocks)
        return graphs if graphs.capture() else None

    def graph_decode_batch(self) -> DecodeBatch | None:
        """This step's decode batch when every row is a local decode token (else None)."""
        m = self._meta
        if m is None or m.has_sp or m.transitions or not m.local_decode or self._pending is not None:
            return None
        return self._dec_batch

    def paged_kernel_ready(self, batch: DecodeBatch) -> bool:
        """Whether ``batch`` takes the (validated) Triton paged decode kernel."""
        return self._use_kernel is True and self._kernel_fits(batch, self._dec_kv_of_q)

    def _paged(self, layer: int, q: torch.Tensor, batch, kv_of_q: list[int]) -> torch.Tensor:
        """One query token per request over its paged KV (``batch``'s view) -> [B, hq, D]."""
        on = q.is_cuda or self._force_kernel  # force: Triton interpreter on CPU (tests)
        if self._use_kernel is not False and on and self._kernel_fits(batch, kv_of_q):
            kv_k, kv_v = self.kv.decode_views(layer, batch.prefill)
            out = paged_decode_attention(q, kv_k, kv_v, batch.table, batch.lengths, self.scale, batch.work,
                                         self.decode_kernel)
            if self._use_kernel is None:  # first use: validate against the torch path once
                ref = self._paged_torch(layer, q, batch, kv_of_q)
                err = (out.float() - ref.float()).abs().max().item()
                self._use_kernel = err < 2e-2
                if not self._use_kernel:
                    warnings.warn(f"Triton paged decode differs from torch by {err:.3g}: using torch")
                    return ref
            return out
        return self._paged_torch(layer, q, batch, kv_of_q)

    def _with_work(self, batch: DecodeBatch) -> DecodeBatch:
        """``batch`` with the paged kernel's work list (CUDA; built once per step for every layer)."""
        if not batch.table.is_cuda or not triton_available():
            return batch
        tpb = self.kv.prefill_tpb if batch.prefill else self.kv.decode_tpb
        heads = self.kv.prefill_kv_heads if batch.prefill else self.kv.num_kv_heads
        work = decode_work(list(batch.host_lengths), tpb, heads, self.decode_kernel, batch.table.device)
        return replace(batch, work=work)

    def _paged_torch(self, layer: int, q: torch.Tensor, batch, kv_of_q: list[int]) -> torch.Tensor:
        kp, vp = self.kv.read_decode(layer, batch)  # [B, S_max, hkv, D] gathered copy
        return decode_attention(q, kp.to(q.dtype), vp.to(q.dtype), batch.lengths, kv_of_q, self.scale)

    def _kernel_fits(self, batch, kv_of_q: list[int]) -> bool:
        """The Triton kernel handles plain GQA with power-of-two tokens per block and head dim."""
        view_heads = self.kv.prefill_kv_heads if batch.prefill else self.kv.num_kv_heads
        tpb = self.kv.prefill_tpb if batch.prefill else self.kv.decode_tpb
        d = self.kv.head_dim
        if not triton_available() or len(kv_of_q) % view_heads:
            return False
        g = len(kv_of_q) // view_heads
        pow2 = tpb >= 16 and tpb & (tpb - 1) == 0 and d >= 16 and d & (d - 1) == 0
        return pow2 and kv_of_q == [i // g for i in range(len(kv_of_q))]

    # ---- prefill -> decode transition --------------------------------------------------
    def _gather(self, layer: int, meta: XPStepMeta) -> None:
        """Send this layer's head shards of each finishing prompt to its decode rank.

        Each kv head comes from its first holder (replicated heads are sent once). The decode
        rank writes the full-head KV ``[L, hkv, D]`` into its decode view.
        """
        h, me = self.heads, self.groups.rank
        shard = h.sp_shard
        owned = [j for j in range(shard.num_kv) if h.kv_owner(shard.kv_lo + j) == me]  # contiguous
        own = slice(owned[0], owned[-1] + 1) if owned else slice(0, 0)
        send: list[list[torch.Tensor]] = [[] for _ in h.sp_shards]
        recv_numels = [0] * len(h.sp_shards)
        d = self.kv.head_dim
        for t in meta.transitions:
            kk, vv = self.kv.read_at(layer, self._gather_blocks[t.request_id], t.prompt_len, True)  # [L, h_me, D]
            kk, vv = kk[t.start:], vv[t.start:]  # positions the decode rank lacks (after a prefix hit)
            send[t.decode_rank] += [kk[:, own].reshape(-1), vv[:, own].reshape(-1)]  # own: a slice
            if t.decode_rank == me:
                for p, s in enumerate(h.sp_shards):
                    n_own = sum(1 for j in range(s.kv_lo, s.kv_hi) if h.kv_owner(j) == p)
                    recv_numels[p] += 2 * (t.prompt_len - t.start) * n_own * d
        empty = self.kv.k.new_empty(0)
        flat = [torch.cat(s) if s else empty for s in send]
        _, finish = all_to_all_flat(flat, recv_numels, self.groups.sp, async_op=True)
        self._pending = (layer, meta, finish, flat)  # completed while the next layer's linears run

    def _finish_gather(self) -> None:
        """Wait for the pending transition all-to-all and write the full-head KV (decode rank)."""
        if self._pending is None:
            return
        layer, meta, finish, _keep_alive = self._pending
        self._pending = None
        h, me, d = self.heads, self.groups.rank, self.kv.head_dim
        got = finish()
        cursors = [0] * len(got)
        for t in meta.transitions:
            if t.decode_rank != me:
                continue
            n = t.prompt_len - t.start
            full_k = self.kv.k.new_empty(n, h.num_kv, d)  # [n, hkv_dev, D]: positions [start, prompt_len)
            full_v = torch.empty_like(full_k)
            for p, s in enumerate(h.sp_shards):
                heads_p = [j for j in range(s.kv_lo, s.kv_hi) if h.kv_owner(j) == p]
                if not heads_p:
                    continue
                numel = n * len(heads_p) * d
                kp = got[p][cursors[p]:cursors[p] + numel].view(n, len(heads_p), d)
                vp = got[p][cursors[p] + numel:cursors[p] + 2 * numel].view(n, len(heads_p), d)
                cursors[p] += 2 * numel
                cols = slice(heads_p[0] - h.tp_shard.kv_lo, heads_p[-1] + 1 - h.tp_shard.kv_lo)  # contiguous
                full_k[:, cols] = kp
                full_v[:, cols] = vp
            wb, wo, rows = self._decode_slots[t.request_id]
            self.kv.write_at(layer, wb, wo, full_k, full_v, prefill=False, rows=rows)


def _rows_of(token_idx: torch.Tensor, device: torch.device) -> slice | torch.Tensor:
    """A segment's rows of the received array: a slice when consecutive (no gather copy)."""
    n = token_idx.numel()
    first = int(token_idx[0]) if n else 0
    if n and int(token_idx[-1]) - first + 1 == n and bool((token_idx.diff() == 1).all()):
        return slice(first, first + n)
    return tensor_to_device(token_idx, device)


def _decode_stream(device: torch.device, sms: int | None):
    """(stream, green context or None): the side stream decode attention runs on."""
    if sms:
        try:
            from torch.cuda.green_contexts import GreenContext

            green = GreenContext.create(num_sms=sms, device_id=device.index)
            return green.Stream(), green  # keep the context alive with the stream
        except Exception as e:  # noqa: BLE001 - beta API that differs between torch versions
            warnings.warn(f"GreenContext with {sms} SMs unavailable ({e!r}); using a plain stream")
    return torch.cuda.Stream(device=device), None
