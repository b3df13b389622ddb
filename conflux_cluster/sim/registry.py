"""The evaluated systems, their configuration sweeps, and the evaluation settings (paper §8.1).

A ``Setting`` is (model, hardware, GPUs, base TP, SLOs, where the costs come from). Each system
name maps to the list of ``SystemConfig``s swept for it; the best (highest goodput) is reported,
as the paper does for every baseline. Names ending in "++" use SRPT (fewest remaining prefill
tokens first) instead of FCFS. ConfluxServe: "conflux-fcfs" (XP, waterfill TBT-safe dispatch,
FCFS order) and "conflux" (the full SLO scheduler, Alg. 1-4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.estimator import EstimatorProfile
from conflux_cluster.slo import SLO

from .core import Recorder, SimInstance
from .costs import ComponentCosts
from .hardware import ModelSpec, SimHardware
from .limits import EngineLimits
from .step_noise import StepNoise
from .systems.distserve import DistServeInstance
from .systems.engine_sched import ChunkedSPInstance, ChunkedTPInstance, NoCobatchInstance, XPInstance
from .systems.loongserve import LoongServeInstance
from .systems.muxwise import MuxWiseInstance

SLO_MARGIN = 0.95  # estimator-driven schedulers aim at 95% of the TBT SLO (room for per-step overhead)
CHUNK_BUDGETS = (1024, 2048, 4096, 8192)  # fixed token budgets swept for chunked prefill (+ the engine's own)


@dataclass(frozen=True)
class Setting:
    """One evaluation setting."""

    model: ModelSpec
    hw: SimHardware
    num_gpus: int  # GPUs of the instance (every system gets the same)
    base_tp: int  # TP degree of one XP rank / LoongServe instance
    slo: SLO
    profile: EstimatorProfile | None = None  # fitted XP profile (base TP ranks); None: roofline
    limits: EngineLimits = field(default_factory=EngineLimits.from_engine)  # decode slots, budget, KV share
    # what ConfluxServe's scheduler plans with where it differs from ``profile`` (which times every step):
    # an estimator that is off, as a real engine's may be; None: it plans with ``profile``
    plan_profile: EstimatorProfile | None = None
    # served steps' measured / modelled time ratios, replayed on every step of the engine-scheduler systems
    # (conflux, chunked-*, no-cobatch); None: steps take exactly their modelled time
    step_noise: StepNoise | None = None

    @property
    def num_ranks(self) -> int:
        return self.num_gpus // self.base_tp

    def costs(self, tp: int | None = None) -> ComponentCosts:
        hw = self.limits.hardware(self.hw)  # KV capacity from the engine's memory share
        base = (ComponentCosts.from_profile(self.profile, self.model, hw, self.base_tp)
                if self.profile else ComponentCosts.roofline(self.model, hw, self.base_tp))
        return base.scaled(tp or self.base_tp)


@dataclass(frozen=True)
class SystemConfig:
    """One system at one configuration: ``build(setting)`` gives the instance factory."""

    system: str  # display name, e.g. "chunked++"
    kind: str  # conflux | chunked-tp | chunked-sp | no-cobatch | distserve | loongserve | muxwise
    policy: str  # slo | fcfs | srpt
    knobs: tuple[tuple[str, object], ...] = ()  # swept parameters

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.knobs)
        return f"{self.system}[{extra}]" if extra else self.system

    def build(self, s: Setting) -> Callable[[Recorder], SimInstance]:
        k = dict(self.knobs)
        lim = s.limits
        if self.kind in ("conflux", "chunked-tp", "chunked-sp", "no-cobatch"):
            return partial(self._engine_instance, s, k)
        if self.kind == "distserve":  # each decode replica: its GPUs' share of the instance's decode slots
            c = s.costs(1)
            return lambda rec: DistServeInstance(rec, c, k["p_tp"], k["p_dp"], k["d_tp"], k["d_dp"], self.policy,
                                                 max_seqs=lim.decode_slots(k["d_tp"], s.num_gpus))
        if self.kind == "loongserve":  # splits max_num_seqs over its elastic instances itself
            c = s.costs()
            return lambda rec: LoongServeInstance(rec, c, s.num_ranks, self.policy, k["max_prefill_tokens"],
                                                  k["sp"], lim.max_num_seqs)
        if self.kind == "muxwise":
            c = s.costs(s.num_gpus)
            return lambda rec: MuxWiseInstance(rec, c, self.policy, s.slo, k["chunk_tokens"], lim.max_num_seqs)
        raise ValueError(f"unknown system kind {self.kind!r}")

    def _engine_instance(self, s: Setting, k: dict, rec: Recorder) -> SimInstance:
        budget, lim = k.get("budget", "tbt"), s.limits
        fields = dict(policy=self.policy, token_budget="estimator" if budget == "tbt" else "fixed",
                      max_num_batched_tokens=budget if budget != "tbt" else lim.max_num_batched_tokens,
                      max_num_seqs=lim.max_num_seqs, max_level=lim.max_level, ttft_slo=s.slo.ttft_s,
                      tbt_slo=s.slo.tbt_s, slo_margin=SLO_MARGIN, enable_prefix_caching=bool(k.get("prefix_cache")),
                      prefix_wait_inflight=k.get("prefix_wait", True), max_step_stretch=k.get("stretch", 1.0),
                      idle_step_stretch=k.get("idle_stretch", SchedulerConfig().idle_step_stretch),
                      refit_every=0)  # simulated steps take what a profile says: nothing to refit
        cfg = SchedulerConfig(**{**fields, **dict(k.get("scheduler", ()))})  # "scheduler": fields set on top
        noise = s.step_noise
        if self.kind == "conflux":
            return XPInstance(rec, s.costs(), s.num_ranks, cfg, s.slo, s.profile, s.plan_profile,
                              pipelined=lim.pipelined, noise=noise)
        if self.kind == "no-cobatch":
            return NoCobatchInstance(rec, s.costs(), s.num_ranks, cfg, s.slo, s.profile, s.plan_profile,
                                     pipelined=lim.pipelined, noise=noise)
        if self.kind == "chunked-tp":
            return ChunkedTPInstance(rec, s.costs(s.num_gpus), 1, cfg, s.slo, pipelined=lim.pipelined, noise=noise)
        return ChunkedSPInstance(rec, s.costs(), s.num_ranks, cfg, s.slo, pipelined=lim.pipelined, noise=noise)


def _distserve_splits(s: Setting) -> list[dict]:
    """Feasible static splits: prefill / decode groups of base-TP multiples, DP replicas inside."""
    n, b, out = s.num_gpus, s.base_tp, []
    for p in range(b, n, b):
        for p_tp in (t for t in (b, 2 * b, 4 * b, 8 * b) if t <= p and p % t == 0):
            for d_tp in (t for t in (b, 2 * b, 4 * b, 8 * b) if t <= n - p and (n - p) % t == 0):
                if s.model.num_kv_heads % max(p_tp, d_tp) == 0:
                    out.append({"p_tp": p_tp, "p_dp": p // p_tp, "d_tp": d_tp, "d_dp": (n - p) // d_tp})
    return out


def sweep(system: str, s: Setting, quick: bool = False) -> list[SystemConfig]:
    """The configurations swept for ``system`` (``quick``: the paper's stated configuration only)."""
    base = system.removesuffix("++")
    policy = "srpt" if system.endswith("++") else "fcfs"
    if system == "conflux":
        return [SystemConfig("conflux", "conflux", "slo")]
    if system == "conflux-fcfs":
        return [SystemConfig(system, "conflux", "fcfs")]
    if system == "conflux++":  # XP + waterfill under the baselines' SRPT order (isolates execution)
        return [SystemConfig(system, "conflux", "srpt")]
    if system == "conflux-pc":  # the full SLO scheduler with the prefix cache (on the trace's hash_ids)
        return [SystemConfig(system, "conflux", "slo", (("prefix_cache", True),))]
    if system == "conflux-pc-eager":  # the same, without waiting for a prefix being prefilled (an ablation)
        return [SystemConfig(system, "conflux", "slo", (("prefix_cache", True), ("prefix_wait", False)))]
    if system == "conflux-stretch":  # the SLO scheduler with the step stretch (beyond the paper; x2 and x4)
        return [SystemConfig(system, "conflux", "slo", (("stretch", f),)) for f in ((4.0,) if quick else (2.0, 4.0))]
    if base == "chunked":
        own = s.limits.max_num_batched_tokens  # the engine's default fixed budget is always tried
        budgets = (own, "tbt") if quick else tuple(sorted(set(CHUNK_BUDGETS) | {own})) + ("tbt",)
        cfgs = [SystemConfig(system, "chunked-tp", policy, (("tp", s.num_gpus), ("budget", b))) for b in budgets]
        if not quick:
            cfgs.append(SystemConfig(system, "chunked-sp", policy, (("sp", s.num_ranks), ("budget", "tbt"))))
        return cfgs
    if base == "no-cobatch":  # XP without co-batching (an ablation; the engine's default fixed budget)
        return [SystemConfig(system, "no-cobatch", policy, (("budget", s.limits.max_num_batched_tokens),))]
    if base == "distserve":
        splits = _distserve_splits(s)
        if quick:
            splits = [d for d in splits if d["p_dp"] == d["d_dp"] == 1 and d["p_tp"] == d["d_tp"]] or splits[:1]
        return [SystemConfig(system, "distserve", policy, tuple(d.items())) for d in splits]
    if base == "loongserve":
        m = s.num_ranks
        grid = [(16384, m)] if quick else [(4096, m), (16384, m), (16384, max(1, m // 2))]
        return [SystemConfig(system, "loongserve", policy, (("max_prefill_tokens", t), ("sp", k))) for t, k in grid]
    if base == "muxwise":
        chunks = (8192,) if quick else (2048, 8192)
        return [SystemConfig(system, "muxwise", policy, (("chunk_tokens", c),)) for c in chunks]
    raise ValueError(f"unknown system {system!r}; known: {', '.join(ALL_SYSTEMS + EXTRA_SYSTEMS)}")


ALL_SYSTEMS = ("conflux", "conflux-fcfs", "chunked", "chunked++", "distserve", "distserve++",
               "loongserve", "loongserve++", "muxwise", "muxwise++")
FCFS_SYSTEMS = ("conflux-fcfs", "chunked", "distserve", "loongserve", "muxwise")
PLUS_SYSTEMS = ("conflux", "chunked++", "distserve++", "loongserve++", "muxwise++")
# not in the default matrix: XP under SRPT instead of the SLO scheduler; XP with the prefix cache (and
# without its in-flight wait); XP without co-batching; the SLO scheduler with the step stretch (SchedulerConfig.max_step_stretch)
EXTRA_SYSTEMS = ("conflux++", "conflux-pc", "conflux-pc-eager", "no-cobatch", "no-cobatch++", "conflux-stretch")
