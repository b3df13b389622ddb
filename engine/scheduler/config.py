"""Scheduler configuration (validated; unknown fields are rejected with the field's name)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Literal["slo", "fcfs", "srpt"] = Field(
        "fcfs", description="slo: paper Alg. 1-4; fcfs / srpt: chunked prefill under a fixed token budget")
    max_num_batched_tokens: int = Field(
        256, ge=1, description="fcfs/srpt: combined prefill+decode tokens per rank per step (n_target)")
    max_num_seqs: int = Field(256, ge=1, description="most requests decoding at once on the instance")
    ttft_slo: float = Field(1.0, gt=0, description="seconds from arrival to the first token")
    tbt_slo: float = Field(0.05, gt=0, description="seconds between output tokens (the per-step budget τ)")
    quantum: int = Field(16, ge=1, description="q: n_target is searched in multiples of this (Alg. 2)")
    eta: float = Field(0.8, gt=0, le=1, description="η: KV use above which placement switches to best-fit")
    headroom_blocks: int = Field(0, ge=0, description="h: KV blocks kept free on a rank when placing")
