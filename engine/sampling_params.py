"""Per-request sampling parameters (vLLM-shaped). Validated on construction; errors name the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (vLLM's _SAMPLING_EPS)


class SamplingParams(BaseModel):
    """How to pick output tokens and when to stop.

    A temperature below ``GREEDY_BELOW`` is greedy (as in vLLM: dividing logits by such a value
    overflows float32, so it could only pick garbage). With a ``seed`` the i-th output token is drawn from a generator
    seeded by ``(seed, i)``, so results do not depend on which other requests share the batch or
    on which rank samples. Without a seed the engine draws one at admission.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=64, description="completions per prompt (each its own request)")
    max_tokens: int | None = Field(16, ge=1, description="output cap; None = up to the model's context")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus: smallest set with this probability mass")
    top_k: int = Field(-1, ge=-1, description="keep the k most likely tokens; -1, 0 or >= the vocabulary = all")
    seed: int | None = Field(None, ge=0, description="reproducible sampling per request")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in the output text)")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end the request")
    ignore_eos: bool = Field(False, description="keep generating past EOS (benchmarks)")
    reject_unattainable: bool = Field(
        False, description="policy slo: refuse the request at arrival (DeadlineUnattainable: HTTP 503 slo_unattainable) "
                           "when admission finds its TTFT deadline cannot be met, instead of serving it late; the "
                           "per-request form of scheduler.reject_unattainable (other policies: ignored)")
    logprobs: int | None = Field(None, ge=0, le=20, description="also return this many top logprobs per token")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        return [v] if isinstance(v, str) else list(v)

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
