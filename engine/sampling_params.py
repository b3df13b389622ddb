"""Per-request sampling parameters (vLLM-shaped). Validated on construction; errors name the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .structured.spec import StructuredOutput

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
    logprobs: int | None = Field(None, ge=0, description="also return this many top logprobs per token (the server "
                                 "caps it: ``max_logprobs``)")
    prompt_logprobs: int | None = Field(None, ge=0, description="score every prompt token, with this many "
                                        "alternatives per position (engine/prompt_logprobs.py)")
    # logits processors (engine/penalties.py), vLLM's semantics; each at its neutral value costs nothing
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this for every token already in the output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="minus this times the token's count in the output")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, description="divide a positive logit (multiply a negative one) "
                                      "of every token in the prompt or the output by this")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p x the most likely one")
    min_tokens: int = Field(0, ge=0, description="EOS and stop_token_ids cannot be sampled before this many outputs")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> added to its logit (-100..100)")
    structured: StructuredOutput | None = Field(None, description="grammar the output must match (engine/structured)")
    include_stop_str_in_output: bool = Field(False, description="keep the stop string that ended the text in it")
    skip_special_tokens: bool = Field(True, description="leave special tokens' text out of the output text")

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        bad = [t for t, b in v.items() if not -100.0 <= b <= 100.0]
        if bad:
            raise ValueError(f"logit_bias: the bias of token {bad[0]} is outside [-100, 100]")
        return v

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.structured is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output (the grammar decides the end)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not be more than max_tokens ({self.max_tokens})")
        return self

    @property
    def uses_history(self) -> bool:
        """True when sampling looks at the tokens so far (a penalty other than neutral)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """True when a logits processor (penalty, bias, min_tokens) changes this request's logits."""
        return self.uses_history or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
