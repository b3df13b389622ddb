"""Profile-fitted iteration-latency model (paper Eq. 2-12, App. D). Pure Python.

    T_iter = L · (T_GEMM + T_ATTN [+ κ])
    T_GEMM = f_GEMM(max_r (n_p^r + n_d^r))                  f_GEMM(n) = γ·n + γ0
    T_ATTN = max(β·T_P, α·T_D)
    T_D    = max_r f_D(Σ_{i∈D_r} c_i)                        f_D(W)    = a_D·W + a_D0
    T_P    = f_comm(max_r n_p^r) + f_P((1/N)·Σ_i ℓ_i(c_i + (ℓ_i+1)/2)) [+ k_KV·(1/N)·Σ_i (c_i + ℓ_i)]
             [+ κ_c·(number of chunks)]
                                                             f_P, f_comm affine likewise
Terms with no work (no prefill, no decode) contribute 0, not their intercept.

The bracketed term is an extension (default 0, so Eq. 6 exactly): the KV a chunk's attention
reads, (c_i + ℓ_i) tokens of the rank's heads. It is memory-bound and dominates Eq. 9's FLOP term
for short chunks over long histories (one H200: a 32-token chunk takes 33 ms after a
32K history, 14 ms without one). ``conflux profile`` fits it; roofline profiles leave it 0 unless asked.

κ_c (``chunk_cost``, default 0) is a third: seconds per layer per prefill chunk in the step, whatever its
size (per-chunk launches and metadata; the torch attention path's per-chunk history gather). Served steps
of a bursty trace hold several chunks: with the torch path each extra chunk cost ~0.36 ms per layer on one
H200, which a model without κ_c could not see. ``refine_jointly`` fits it wherever the samples hold
steps of different chunk counts.

κ (``cobatch``, default 0) is a second extension: seconds per layer that a step pays only when it
co-batches prefill and decode tokens, for work neither phase's curve holds (presumably the eager
decode path's launches, since decode-only steps replay one graph, and an overlap of the two attention
paths that the GPU does not deliver; not yet profiled). Measured on one H200 (Llama-3.1-8B):
a 205-token chunk with 19 decodes took 36 ms where Eq. 2 predicts 16 ms; with κ
fitted (0.53 ms per layer) the held-out error of mixed steps fell from 24 % to 6.6 %
(docs/scheduler.md).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class Affine:
    """f(x) = slope·x + intercept (seconds per layer)."""

    slope: float
    intercept: float

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


@dataclass(frozen=True)
class EstimatorProfile:
    """Fitted coefficients for one (model, hardware, ranks). Saved and loaded as JSON."""

    model: str  # e.g. "llama-3.1-8b"
    hardware: str  # e.g. "h200", "cpu-2core"
    num_ranks: int  # N
    num_layers: int  # L
    f_gemm: Affine
    f_prefill_attn: Affine  # f_P over per-rank causal workload (token-pairs)
    f_decode_attn: Affine  # f_D over aggregate decode context on a rank (tokens)
    f_comm: Affine  # f_comm over the largest prefill shard (tokens); zero when N == 1
    alpha: float = 1.0  # contention factor on the decode path (≥ 1)
    beta: float = 1.0  # contention factor on the prefill path (≥ 1)
    meta: dict = field(default_factory=dict)  # fit quality (MAPE), date, command
    f_prefill_kv: Affine = Affine(0.0, 0.0)  # k_KV: seconds per KV token read by prefill attention, per rank
    cobatch: float = 0.0  # κ: seconds per layer a step pays when it co-batches prefill and decode
    query_tile: int = 1  # a chunk's queries attend its history in tiles of this many (prefill_attn_work)
    chunk_cost: float = 0.0  # κ_c: seconds per layer per prefill chunk in the step (on the prefill path)

    def __post_init__(self) -> None:
        if self.query_tile < 1:
            raise ValueError(f"estimator profile query_tile must be >= 1, got {self.query_tile}")

    @property
    def is_budget(self) -> bool:
        """A built-in token budget, not a fit: its level is the budget itself, with no attention terms."""
        return self.meta.get("kind") == "budget"

    @property
    def is_measured(self) -> bool:
        """Fitted from this engine's own measurements (``conflux profile``)."""
        return self.meta.get("kind") == "measured"

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def from_json(cls, path: str | Path) -> "EstimatorProfile":
        """The profile saved at ``path``; FileNotFoundError, or a ValueError naming the file and what is
        wrong (not JSON, a missing or unknown field, a field of the wrong type)."""
        from ..util.json_file import read_json_file

        d = read_json_file(path)
        if not isinstance(d, dict):
            raise ValueError(f"{path}: not an estimator profile (a JSON object), got a JSON {type(d).__name__}")
        known = {f.name: f for f in fields(cls)}
        missing = [n for n, f in known.items() if n not in d and f.default is MISSING and f.default_factory is MISSING]
        unknown = sorted(set(d) - set(known))
        if missing or unknown:
            raise ValueError(f"{path}: not an estimator profile: " + "; ".join(
                ([f"missing field(s) {', '.join(missing)}"] if missing else [])
                + ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])))
        values = {k: _profile_field(path, k, v, known[k].type) for k, v in d.items()}
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _profile_field(path: str | Path, name: str, value: object, annotation: str) -> object:
    """One field of a profile file as its type (annotations are strings here: ``from __future__``)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation == "Affine":
        if (isinstance(value, dict) and set(value) == {"slope", "intercept"}
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value.values())):
            return Affine(float(value["slope"]), float(value["intercept"]))
        expected = '{"slope": number, "intercept": number}'
    elif annotation == "int":
        if number and float(value).is_integer():
            return int(value)
        expected = "an integer"
    elif annotation == "float":
        if number:
            return float(value)
        expected = "a number"
    elif annotation == "str":
        if isinstance(value, str):
            return value
        expected = "a string"
    else:  # meta: dict
        if isinstance(value, dict):
            return value
        expected = "a JSON object"
    raise ValueError(f"{path}: estimator profile field {name}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class BatchLoad:
    """The load summary of one step that the latency model needs.

    prefill_tokens[r] = n_p^r, decode_tokens[r] = n_d^r, decode_context[r] = Σ_{i∈D_r} c_i,
    prefill_chunks = [(ℓ_i, c_i)]: chunk length and already-computed context of each prefill.
    """

    prefill_tokens: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    decode_context: tuple[int, ...]
    prefill_chunks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class LatencyBreakdown:
    """Per-component iteration latency in seconds (already multiplied by L)."""

    gemm: float
    prefill_attn: float
    decode_attn: float
    comm: float
    total: float


def prefill_attn_work(chunks: tuple[tuple[int, int], ...] | list[tuple[int, int]], tile: int = 1) -> float:
    """Σ_i ℓ_i(c_i + (ℓ_i+1)/2): causal token-pairs of the scheduled chunks (Eq. 9).

    With ``tile`` > 1 (a profile's ``query_tile``) the history term counts ℓ_i rounded up to whole
    tiles: a flash kernel runs a chunk's queries in tiles of 128 rows, and over a long history each
    tile costs the same however full it is (one H200: with the partition count tuned per
    tile count, a chunk over a 64K history cost ~0.45 ms per layer per 128-query tile, so a 264-token
    chunk costs a 384-token one's time, not 1.03× a 256-token one's)."""
    return sum(-(-l // tile) * tile * c + l * (l + 1) / 2 for l, c in chunks)


def prefill_kv_tokens(chunks: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> int:
    """Σ_i (c_i + ℓ_i): KV tokens the scheduled chunks' attention reads (history + chunk)."""
    return sum(l + c for l, c in chunks)


class LatencyEstimator:
    """``estimate(BatchLoad) -> LatencyBreakdown`` from an ``EstimatorProfile``.

    ``decode_time`` and ``iteration_time`` are the same model split for the dispatcher's binary
    search: T_D is fixed within a step, so each probe of a water level costs O(1) after an O(N)
    summary of the level (paper §6.3: O(N log B) per dispatch).
    """

    def __init__(self, profile: EstimatorProfile) -> None:
        self.profile = profile

    def decode_time(self, decode_context, decode_tokens) -> float:
        """T_D = max_r f_D(Σ_{i∈D_r} c_i) over ranks with decodes (per layer, before α)."""
        f = self.profile.f_decode_attn
        return max((f(w) for w, n in zip(decode_context, decode_tokens) if n), default=0.0)

    def iteration_time(self, max_combined: int, max_prefill: int, prefill_work: float,
                       decode_time: float, prefill_kv: float = 0.0, has_decode: bool = False,
                       num_chunks: int = 1) -> float:
        """T_iter (Eq. 2) from max_r(n_p^r+n_d^r), max_r n_p^r, Σ ℓ_i(c_i+(ℓ_i+1)/2), T_D, Σ(c_i+ℓ_i),
        whether the step has decodes (κ) and its number of prefill chunks (κ_c)."""
        p = self.profile
        gemm = p.f_gemm(max_combined) if max_combined else 0.0
        if max_prefill:
            comm = p.f_comm(max_prefill) if p.num_ranks > 1 else 0.0
            t_p = comm + p.f_prefill_attn(prefill_work / p.num_ranks) + \
                p.f_prefill_kv.slope * prefill_kv / p.num_ranks + p.chunk_cost * num_chunks
        else:
            t_p = 0.0
        mixed = p.cobatch if max_prefill and has_decode else 0.0
        return p.num_layers * (gemm + max(p.beta * t_p, p.alpha * decode_time) + mixed)

    def estimate(self, load: BatchLoad) -> LatencyBreakdown:
        p = self.profile
        n_max = max((a + b for a, b in zip(load.prefill_tokens, load.decode_tokens)), default=0)
        gemm = p.f_gemm(n_max) if n_max else 0.0
        t_d = self.decode_time(load.decode_context, load.decode_tokens)
        np_max = max(load.prefill_tokens, default=0)
        comm = p.f_comm(np_max) if np_max and p.num_ranks > 1 else 0.0
        t_pa = (p.f_prefill_attn(prefill_attn_work(load.prefill_chunks, p.query_tile) / p.num_ranks)
                + p.f_prefill_kv.slope * prefill_kv_tokens(load.prefill_chunks) / p.num_ranks
                + p.chunk_cost * len(load.prefill_chunks)) if np_max else 0.0
        attn = max(p.beta * (comm + t_pa), p.alpha * t_d)
        mixed = p.cobatch if np_max and any(load.decode_tokens) else 0.0
        L = p.num_layers
        return LatencyBreakdown(gemm=L * gemm, prefill_attn=L * t_pa, decode_attn=L * t_d,
                                comm=L * comm, total=L * (gemm + attn + mixed))


def budget_profile(tbt_slo: float, tokens_per_rank: int, num_ranks: int) -> EstimatorProfile:
    """The built-in "budget" profile: usable without profiling (any hardware, CPU included).

    Iteration time grows only with the largest combined per-rank load and reaches ``tbt_slo``
    at ``tokens_per_rank`` tokens, so ``policy="slo"`` schedules under the same per-rank token
    budget as chunked prefill while keeping its admission, waterfill and placement logic.
    Replace it with a profiled (``conflux profile``) or roofline profile for real SLO control.
    """
    if tokens_per_rank < 1 or tbt_slo <= 0:
        raise ValueError(f"budget profile needs tokens_per_rank >= 1 and tbt_slo > 0, got "
                         f"{tokens_per_rank}, {tbt_slo}")
    zero = Affine(0.0, 0.0)
    return EstimatorProfile(model="any", hardware="budget", num_ranks=num_ranks, num_layers=1,
                            f_gemm=Affine(tbt_slo / tokens_per_rank, 0.0), f_prefill_attn=zero,
                            f_decode_attn=zero, f_comm=zero, alpha=1.0, beta=1.0,
                            meta={"kind": "budget", "tokens_per_rank": tokens_per_rank})


def plan_batch_load(plan, decode_context: Sequence[int], num_ranks: int) -> BatchLoad:
    """The estimator's ``BatchLoad`` of a ``StepPlan`` (the metrics' ``estimated_s``, the simulator's
    step time, benchmarks/steps/trace.py).

    ``decode_context[r]`` is Σ c_i of the decodes resident on rank r when the plan was made.
    Prefill chunks: one (ℓ_i, c_i) per request, ℓ_i = its tokens this step over all ranks,
    c_i = the first position it computes (context already in KV).
    """
    prefill = [0] * num_ranks
    chunks: dict[str, list[int]] = {}  # request id -> [ℓ_i, c_i]
    for sl in plan.prefill:
        prefill[sl.rank] += sl.end - sl.start
        ch = chunks.setdefault(sl.request_id, [0, sl.start])
        ch[0] += sl.end - sl.start
        ch[1] = min(ch[1], sl.start)
    decode = [len(plan.decode[r]) if r < len(plan.decode) else 0 for r in range(num_ranks)]
    return BatchLoad(tuple(prefill), tuple(decode), tuple(int(c) for c in decode_context),
                     tuple((l, c) for l, c in chunks.values()))
