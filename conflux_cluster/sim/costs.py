"""Per-layer operator costs of one TP group: the pieces every simulated system is timed from.

All systems use the same components and differ only in how they compose them (that is what the
paper compares). Each is affine in its work — the form of the paper's estimator (Eq. 2-12) — in
seconds per layer:

    gemm(n)          shared linears (QKV, O, FFN) over n tokens on a TP-d group, incl. its all-reduces
    prefill_attn(w)  causal attention over w token-pairs (all heads), spread over the group's GPUs
    decode_attn(c)   paged decode attention reading c context tokens of KV, spread over the group
    a2a(N)(n)        Ulysses all-to-alls (QKV in, output back) across N groups, largest shard n tokens

``ComponentCosts.roofline`` takes them from the engine's roofline builder
(``engine/scheduler/roofline.py``: ``roofline_profile(model, hw, num_ranks, tp)``) — a TP-d group
is a one-rank profile with ``tp=d``; latency and bus bandwidth of the all-reduces inside TP groups
are the simulator's (``SimHardware.allreduce_latency`` / ``allreduce_busbw``, both generous to TP). ``ComponentCosts.from_profile`` takes a fitted
``EstimatorProfile`` (per rank, base TP) and derives other TP degrees by the roofline's ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conflux_cluster.engine.scheduler.estimator import Affine, EstimatorProfile
from conflux_cluster.engine.scheduler.roofline import roofline_profile

from .hardware import ModelSpec, SimHardware


@dataclass(frozen=True)
class ComponentCosts:
    """Affine per-layer costs (seconds) of one TP-``tp`` group running ``model`` on ``hw``."""

    model: ModelSpec
    hw: SimHardware
    tp: int  # GPUs in the group (tensor parallel degree)
    gemm: Affine  # over tokens in the group's linear batch
    prefill_attn: Affine  # over causal token-pairs processed by this group (all its heads)
    decode_attn: Affine  # over Σ context tokens of the decodes resident on this group
    lm_head: Affine  # per step (not per layer): over sampled tokens
    a2a_full: Affine  # Ulysses all-to-alls per layer as (N−1)/N → 1: slope per token, latency
    prefill_kv: Affine = Affine(0.0, 0.0)  # prefill attention's KV read: slope per KV token (history + chunk)
    alpha: float = 1.1  # decode-path contention when attention paths overlap (≥ 1)
    beta: float = 1.1  # prefill-path contention (≥ 1)
    cobatch: float = 0.0  # κ: per layer, paid by a step that co-batches prefill and decode (fitted; roofline 0)
    chunk_cost: float = 0.0  # κ_c: per layer per prefill chunk in the step (fitted; roofline 0)
    query_tile: int = 1  # history attention counts a chunk's queries in whole tiles (a fitted profile's)
    source: str = "roofline"

    @classmethod
    def roofline(cls, model: ModelSpec, hw: SimHardware, tp: int = 1) -> "ComponentCosts":
        if model.num_q_heads % tp or model.num_kv_heads % tp:
            raise ValueError(f"TP{tp} does not divide {model.name}'s heads")
        tp_hw = replace(hw.roofline, collective_latency=hw.allreduce_latency,  # TP all-reduces
                        link_efficiency=hw.allreduce_busbw / hw.roofline.link_bandwidth)
        one = roofline_profile(model.dims(), tp_hw, 1, tp)
        two = roofline_profile(model.dims(), hw.roofline, 2, tp)  # f_comm at (N−1)/N = 1/2
        a2a = Affine(2 * two.f_comm.slope, two.f_comm.intercept)
        lm_bytes = model.vocab * model.hidden * model.dtype_bytes
        lm = Affine(2 * model.vocab * model.hidden / (tp * hw.gemm_flops), lm_bytes / (tp * hw.mem_bw))
        return cls(model, hw, tp, gemm=one.f_gemm, prefill_attn=one.f_prefill_attn, decode_attn=one.f_decode_attn,
                   lm_head=lm, a2a_full=a2a, prefill_kv=one.f_prefill_kv, alpha=one.alpha, beta=one.beta)

    @classmethod
    def from_profile(cls, profile: EstimatorProfile, model: ModelSpec, hw: SimHardware,
                     base_tp: int = 1) -> "ComponentCosts":
        """Per-rank fitted components (a rank = one TP-``base_tp`` group); LM head from the roofline."""
        base = cls.roofline(model, hw, base_tp)
        n = profile.num_ranks
        a2a = base.a2a_full if n == 1 else Affine(profile.f_comm.slope * n / (n - 1), profile.f_comm.intercept)
        return replace(base, gemm=profile.f_gemm, decode_attn=profile.f_decode_attn,
                       prefill_attn=profile.f_prefill_attn, a2a_full=a2a, alpha=profile.alpha,
                       prefill_kv=Affine(profile.f_prefill_kv.slope, 0.0), cobatch=profile.cobatch,
                       chunk_cost=profile.chunk_cost,
                       beta=profile.beta, query_tile=profile.query_tile,
                       source=f"profile:{profile.model}/{profile.hardware}/N{n}")

    def scaled(self, tp: int) -> "ComponentCosts":
        """The same components on a TP-``tp`` group (work split over more GPUs, all-reduces added)."""
        if tp == self.tp:
            return self
        new = ComponentCosts.roofline(self.model, self.hw, tp)
        if self.source == "roofline":
            return replace(new, alpha=self.alpha, beta=self.beta)
        old = ComponentCosts.roofline(self.model, self.hw, self.tp)

        def ratio(fitted: Affine, ref_old: Affine, ref_new: Affine) -> Affine:
            return Affine(fitted.slope * ref_new.slope / ref_old.slope,
                          fitted.intercept * ref_new.intercept / ref_old.intercept)

        return replace(self, tp=tp, gemm=ratio(self.gemm, old.gemm, new.gemm),
                       prefill_attn=ratio(self.prefill_attn, old.prefill_attn, new.prefill_attn),
                       decode_attn=ratio(self.decode_attn, old.decode_attn, new.decode_attn),
                       lm_head=new.lm_head, a2a_full=ratio(self.a2a_full, old.a2a_full, new.a2a_full),
                       prefill_kv=Affine(self.prefill_kv.slope * new.decode_attn.slope / old.decode_attn.slope, 0.0))

    # ---- composed pieces ----------------------------------------------------------------------
    def prefill_time(self, pairs: float, kv_tokens: float, num_chunks: int = 1) -> float:
        """Prefill attention per layer over ``pairs`` causal pairs reading ``kv_tokens`` KV tokens, in
        ``num_chunks`` chunks."""
        return self.prefill_attn(pairs) + self.prefill_kv.slope * kv_tokens + self.chunk_cost * num_chunks

    def a2a(self, num_ranks: int) -> Affine:
        """Ulysses all-to-alls per layer over ``num_ranks`` groups, in the largest shard's tokens."""
        if num_ranks <= 1:
            return Affine(0.0, 0.0)
        return Affine(self.a2a_full.slope * (num_ranks - 1) / num_ranks, self.a2a_full.intercept)

    def step_overhead(self, sampled: int) -> float:
        """Per-iteration cost outside the layers: LM head over sampled tokens plus a fixed overhead."""
        return self.hw.step_overhead + (self.lm_head(sampled) if sampled else 0.0)

    def kv_transfer(self, tokens: int, parallel_links: int = 1) -> float:
        """Seconds to move ``tokens`` of KV (all layers) between GPU groups over NVLink."""
        return (self.hw.roofline.collective_latency
                + tokens * self.model.kv_bytes_per_token / (parallel_links * self.hw.link_bw))


def xp_profile(costs: ComponentCosts, num_ranks: int) -> EstimatorProfile:
    """The estimator profile of an XP instance of ``num_ranks`` ranks, each a TP-``costs.tp`` group.

    With roofline costs this is ``roofline_profile(model, hw, N, tp)`` (TP all-reduce latency as
    in ``SimHardware``). Ulysses spreads the causal pairs over the N ranks: the estimator's f_P
    takes per-rank pairs (it divides Σ work by N itself), so f_P is the group's prefill attention.
    """
    return EstimatorProfile(
        model=costs.model.name, hardware=costs.hw.name, num_ranks=num_ranks,
        num_layers=costs.model.num_layers, f_gemm=costs.gemm, f_prefill_attn=costs.prefill_attn,
        f_decode_attn=costs.decode_attn, f_comm=costs.a2a(num_ranks), alpha=costs.alpha, beta=costs.beta,
        f_prefill_kv=costs.prefill_kv, cobatch=costs.cobatch, query_tile=costs.query_tile,
        chunk_cost=costs.chunk_cost,
        meta={"source": f"conflux_cluster.sim.costs ({costs.source}), base TP{costs.tp}"})
