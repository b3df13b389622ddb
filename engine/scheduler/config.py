"""Scheduler configuration (validated; unknown fields are rejected with the field's name)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .policies import POLICIES, get_policy


class SchedulerConfig(BaseModel):
    # allow_inf_nan=False: every float field (SLOs, margins) is finite; 'inf' / 'nan' are errors naming it
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    policy: str = Field(
        "slo", description="; ".join(f"{p.name}: {p.description}" for p in POLICIES.values())
        + " (engine/scheduler/policies.py registers them)", json_schema_extra={"choices": list(POLICIES)})
    token_budget: Literal["auto", "fixed", "estimator"] = Field(
        "auto", description="how n_target is chosen each step: fixed = max_num_batched_tokens per rank; "
                            "estimator = waterfill binary search under the TBT SLO (Alg. 2); "
                            "auto = estimator for policy 'slo', fixed otherwise")
    max_num_batched_tokens: int = Field(
        256, ge=1, description="fixed n_target: combined prefill+decode tokens per rank per step; "
                               "also the per-rank level of the built-in 'budget' estimator profile")
    max_num_seqs: int = Field(256, ge=1, description="most requests decoding at once on the instance")
    ttft_slo: float = Field(1.0, gt=0, le=86400, description="seconds from arrival to the first token")
    tbt_slo: float = Field(0.1, gt=0, le=3600, description="seconds between output tokens (the per-step budget τ): "
                                                          "token i is due by arrival + ttft_slo + (i-1) tbt_slo")
    slo_margin: float = Field(1.0, gt=0, le=1, description="fraction of tbt_slo an estimated iteration may use")
    calibrate_steps: bool = Field(
        True, description="with a fitted estimator profile: scale the per-step budget by the measured / estimated "
                          "time of recent steps that carried prefill (an exponential average, kept within 0.8-2), "
                          "so estimator error and host time do not push steps past tbt_slo")
    refit_every: int = Field(
        64, ge=0, description="with a fitted estimator profile: refit it on the instance's own served steps "
                              "every this many steps (with the profiler's samples, when a raw-<profile> file "
                              "lies beside it), in a background process; a refit replaces the profile only when "
                              "it estimates those steps better (engine/scheduler/fitting/online.py); 0 = off")
    refit_window: int = Field(512, ge=2, description="the latest served steps a refit uses (>= 2 x refit_every)")
    max_step_stretch: float = Field(
        1.0, ge=1.0, le=16.0, description="policy 'slo': a step's prefill may take up to this many times tbt_slo when "
                                          "every decode it carries keeps half of its slack to its next per-token "
                                          "deadline (arrival + ttft_slo + (i-1) tbt_slo); 1 = every step within "
                                          "tbt_slo, as the paper's scheduler does")
    idle_step_stretch: float = Field(
        4.0, ge=1.0, le=16.0, description="policy 'slo' with a fitted profile: a step that carries no decode may "
                                          "take up to this many times tbt_slo (no token is due from it; a lone "
                                          "long prompt otherwise shrinks to chunks of a few hundred tokens as "
                                          "its history grows); 1 = every step within tbt_slo")
    quantum: int = Field(16, ge=1, description="q: n_target is searched in multiples of this (Alg. 2)")
    max_level: int = Field(16384, ge=1, description="highest per-rank combined load n_target the search tries")
    eta: float = Field(0.8, gt=0, le=1, description="η: KV use above which placement switches to best-fit")
    headroom_blocks: int = Field(0, ge=0, description="h: KV blocks kept free on a rank when placing")
    decode_reserve_tokens: int = Field(
        256, ge=0, description="output tokens of KV growth a decode placement must find room for (KV is "
                               "allocated as tokens are produced; a rank that runs out preempts its newest "
                               "request, which recomputes later)")
    deferred_wait_factor: float = Field(
        2.0, ge=1, le=1000, description="policy 'slo': a request admission gave up on (it would miss its TTFT "
                                        "deadline) takes overdue_share of each step ahead of the admitted ones, in "
                                        "arrival order, once it has waited this many times what first-come-first-"
                                        "served would have made it wait (a virtual FCFS clock over the prefill work "
                                        "that arrived before it), and at least ttft_slo (engine/scheduler/deferred.py)")
    deferred_first_factor: float = Field(
        4.0, ge=1, le=1000, description="policy 'slo': ... and goes before the admitted ones outright once it has "
                                        "waited this many times its FCFS wait (at least deferred_wait_factor): under "
                                        "overload its TTFT stays within this multiple of FCFS's")
    overdue_share: float = Field(
        0.25, gt=0, le=1, description="policy 'slo': the share of each step's token budget that deferred requests "
                                      "past deferred_wait_factor take ahead of the admitted ones, which take the "
                                      "rest first (1: the overdue go first outright from deferred_wait_factor on)")
    max_deferred_wait: float | None = Field(
        None, gt=0, le=86400, description="policy 'slo', seconds: a deferred request goes first outright after this "
                                          "wait at the latest, whatever FCFS would have done (unset: no such cap)")
    admission_fallback_accuracy: float = Field(
        0.8, ge=0, le=1, description="policy 'slo': when fewer than this share of admission's recent meets / misses "
                                     "predictions came true (first token by its TTFT deadline or not), order prefills "
                                     "first-come-first-served until the share is 0.05 above it (engine/scheduler/"
                                     "outcomes.py); 0 = never fall back")
    admission_window: int = Field(64, ge=8, le=100000,
                                  description="policy 'slo': how many of the latest resolved predictions the "
                                              "admission accuracy is measured over (at least half of them first)")
    reject_unattainable: bool = Field(
        False, description="policy 'slo' only: refuse a request at arrival when Moore-Hodgson admission (Alg. 4) "
                           "over the queue with it drops it, i.e. its TTFT deadline cannot be met under the current "
                           "load (the client gets 503 slo_unattainable + Retry-After at once); off: it is served "
                           "late, after the on-time ones (SJF backfill)")
    enable_prefix_caching: bool | None = Field(
        None, description="reuse the KV of cached prompt prefixes (chained hashes of full KV blocks, LRU "
                         "eviction of unreferenced blocks; docs/prefix-caching.md); a request with a hit "
                         "decodes on the rank that holds its prefix. Default (unset): the engine turns it on, "
                         "as vLLM and SGLang do, except under xp_mode uniform-sp (no decode layout to cache in)")
    prefix_pin_tokens: int = Field(
        2048, ge=0, description="a prefix-cache hit makes a request decode on the rank holding its prefix; "
                                "it takes the longest hit only if that saves this many more prompt tokens than "
                                "the hit on the rank placement would pick (keeps short shared prefixes from "
                                "piling decodes onto one rank)")
    prefix_wait_inflight: bool = Field(
        True, description="with the prefix cache: a request whose prefix a started prefill is computing waits "
                          "for it to be cached instead of computing it again, when that prefill has no more "
                          "prompt tokens left than the request would reuse (docs/prefix-caching.md)")
    estimator_profile: str = Field(
        "auto", description="'auto' (the serving layer picks a profile fitted for this hardware, model and "
                            "ranks, profiling once at first start on GPUs; 'budget' where none is found), "
                            "'budget' (built in, no profiling needed) or a path to an EstimatorProfile "
                            "JSON written by `conflux profile` or roofline.py")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        get_policy(v)  # ValueError naming the known ones
        return v

    @model_validator(mode="after")
    def _check(self) -> "SchedulerConfig":
        if self.max_level < self.quantum:
            raise ValueError(f"max_level={self.max_level} must be >= quantum={self.quantum}")
        if self.refit_every and self.refit_window < 2 * self.refit_every:
            raise ValueError(f"refit_window={self.refit_window} must be >= 2 x refit_every={self.refit_every}")
        if self.reject_unattainable and not get_policy(self.policy).admission:
            raise ValueError(f"reject_unattainable needs a policy with admission at arrival (Moore-Hodgson: "
                             f"'slo'), not {self.policy!r}")
        return self

    def deferred_wait(self) -> float:
        """Seconds after which a deferred request goes first at the latest (``max_deferred_wait``; inf: unset)."""
        return self.max_deferred_wait if self.max_deferred_wait is not None else math.inf

    def uses_estimator(self) -> bool:
        """True when n_target comes from the latency estimator (waterfill search)."""
        if self.token_budget == "auto":
            return get_policy(self.policy).uses_estimator
        return self.token_budget == "estimator"
