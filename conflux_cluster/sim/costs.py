"""Per-layer operator costs of one TP group, and the XP estimator profile built from them.

Every system in the simulator is timed from the same components, so they differ only in how
they compose them (that is what the paper compares). All functions are affine in their work,
exactly the form of the paper's estimator (Eq. 2-12), in seconds per layer:

    gemm(n)        shared linears (QKV, O, FFN) over n tokens on a TP-d group, incl. 2 all-reduces
    prefill_attn(w) causal attention over w token-pairs (all heads), spread over the group's GPUs
    decode_attn(c) paged decode attention reading c context tokens of KV, spread over the group
    a2a(n)         Ulysses all-to-alls (QKV in, output back) for a largest shard of n tokens

``ComponentCosts.roofline(model, hw, tp)`` derives them from hardware figures:
``gemm(n) = W/(d·BW) + n·2P/(d·F) + all-reduce(n)`` (weights streamed once per step plus compute;
the sum, not the max, of the two roofline terms: the affine form the estimator fits).
``ComponentCosts.from_profile`` takes a fitted ``EstimatorProfile`` (base TP, per rank) instead.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conflux_cluster.engine.scheduler.estimator import Affine, EstimatorProfile

from .hardware import HardwareSpec, ModelSpec

ATTN_OVERLAP = 1.1  # α = β: slowdown of each attention path when prefill and decode share SMs


@dataclass(frozen=True)
class ComponentCosts:
    """Affine per-layer costs (seconds) of one TP-``tp`` group running ``model`` on ``hw``."""

    model: ModelSpec
    hw: HardwareSpec
    tp: int  # GPUs in the group (tensor parallel degree)
    gemm: Affine  # over tokens in the group's linear batch
    prefill_attn: Affine  # over causal token-pairs processed by this group (all its heads)
    decode_attn: Affine  # over Σ context tokens of the decodes resident on this group
    lm_head: Affine  # per step (not per layer): over sampled tokens
    alpha: float = ATTN_OVERLAP
    beta: float = ATTN_OVERLAP
    source: str = "roofline"

    @classmethod
    def roofline(cls, model: ModelSpec, hw: HardwareSpec, tp: int = 1) -> "ComponentCosts":
        if model.num_q_heads % tp or model.num_kv_heads % tp:
            raise ValueError(f"TP{tp} does not divide {model.name}'s heads")
        p = model.linear_params * model.dtype_bytes
        ar_slope = 0.0 if tp == 1 else 2 * (2 * (tp - 1) / tp) * model.hidden * model.dtype_bytes / hw.allreduce_bw
        ar_lat = 0.0 if tp == 1 else 2 * hw.allreduce_latency
        gemm = Affine(slope=2 * model.linear_params / (tp * hw.gemm_flops) + ar_slope,
                      intercept=p / (tp * hw.mem_bw) + ar_lat)
        pair_flops = 4 * model.head_dim * model.num_q_heads  # QKᵀ and PV, all heads
        prefill = Affine(pair_flops / (tp * hw.attn_flops), 10e-6)
        decode = Affine(model.kv_bytes_per_token_layer / (tp * hw.mem_bw), 5e-6)
        lm_bytes = model.vocab * model.hidden * model.dtype_bytes
        lm = Affine(2 * model.vocab * model.hidden / (tp * hw.gemm_flops), lm_bytes / (tp * hw.mem_bw))
        return cls(model, hw, tp, gemm, prefill, decode, lm)

    @classmethod
    def from_profile(cls, profile: EstimatorProfile, model: ModelSpec, hw: HardwareSpec,
                     base_tp: int = 1) -> "ComponentCosts":
        """Per-rank fitted components (a rank = one TP-``base_tp`` group); comm/LM head from ``hw``."""
        base = cls.roofline(model, hw, base_tp)
        n = profile.num_ranks  # estimator's f_P is over per-rank pairs = total / N
        return replace(base, gemm=profile.f_gemm, decode_attn=profile.f_decode_attn,
                       prefill_attn=profile.f_prefill_attn, alpha=profile.alpha, beta=profile.beta,
                       source=f"profile:{profile.model}/{profile.hardware}/N{n}")

    def scaled(self, tp: int) -> "ComponentCosts":
        """The same components on a TP-``tp`` group (compute and streams split, all-reduce added)."""
        if tp == self.tp:
            return self
        if self.source == "roofline":
            return replace(ComponentCosts.roofline(self.model, self.hw, tp), alpha=self.alpha, beta=self.beta)
        k = self.tp / tp
        ref_old, ref_new = (ComponentCosts.roofline(self.model, self.hw, t) for t in (self.tp, tp))
        ar = Affine(ref_new.gemm.slope - ref_old.gemm.slope * k, ref_new.gemm.intercept - ref_old.gemm.intercept * k)
        gemm = Affine(self.gemm.slope * k + ar.slope, self.gemm.intercept * k + ar.intercept)
        return replace(self, tp=tp, gemm=gemm, prefill_attn=Affine(self.prefill_attn.slope * k, self.prefill_attn.intercept),
                       decode_attn=Affine(self.decode_attn.slope * k, self.decode_attn.intercept),
                       lm_head=ref_new.lm_head)

    # ---- composed pieces ----------------------------------------------------------------------
    def a2a(self, num_ranks: int) -> Affine:
        """Ulysses all-to-alls per layer over ``num_ranks`` groups, in the largest shard's tokens."""
        if num_ranks <= 1:
            return Affine(0.0, 0.0)
        m = self.model
        per_token = (2 * m.num_q_heads + 2 * m.num_kv_heads) * m.head_dim * m.dtype_bytes  # QKV in + O out
        frac = (num_ranks - 1) / num_ranks
        return Affine(per_token * frac / (self.tp * self.hw.link_bw), 2 * self.hw.a2a_latency)

    def step_overhead(self, sampled: int) -> float:
        """Per-iteration cost outside the layers: LM head over sampled tokens plus a fixed overhead."""
        return self.hw.step_overhead + (self.lm_head(sampled) if sampled else 0.0)

    def kv_transfer(self, tokens: int, parallel_links: int = 1) -> float:
        """Seconds to move ``tokens`` of KV (all layers) between GPU groups over NVLink."""
        return self.hw.a2a_latency + tokens * self.model.kv_bytes_per_token / (parallel_links * self.hw.link_bw)


def xp_profile(costs: ComponentCosts, num_ranks: int) -> EstimatorProfile:
    """The estimator profile of an XP instance of ``num_ranks`` ranks, each a TP-``costs.tp`` group.

    Ulysses spreads the causal pairs over the N ranks: the estimator's f_P takes per-rank pairs
    (it divides Σ work by N itself), so f_P is this group's prefill attention as is.
    """
    return EstimatorProfile(
        model=costs.model.name, hardware=costs.hw.name, num_ranks=num_ranks,
        num_layers=costs.model.num_layers, f_gemm=costs.gemm, f_prefill_attn=costs.prefill_attn,
        f_decode_attn=costs.decode_attn, f_comm=costs.a2a(num_ranks), alpha=costs.alpha, beta=costs.beta,
        meta={"source": f"conflux_cluster.sim.costs ({costs.source}), base TP{costs.tp}"})
