"""Waterfill prefill dispatch (paper §6.3, Alg. 2, App. E).

Within one step the scheduler keeps a ``StepState``: each rank's combined load
``n_d^r + n_p^r`` (decode tokens are fixed; prefill grows as chunks are accepted), its prefill
tokens ``n_p^r``, the causal-attention work of the chunks accepted so far, and T_D. For a
candidate request with ``m`` remaining prompt tokens and ``c`` computed ones, the dispatcher finds
the highest water level ``n_target = q·k`` whose estimated iteration stays under the TBT budget::

    level q·k:  B(k) = Σ_r max(0, q·k − load_r)       ℓ(k) = min(m, B(k))
    feasible(k) ⇔ T_iter(loads after pouring ℓ(k) toward q·k, work + ℓ(c + (ℓ+1)/2)) ≤ τ

T_iter is nondecreasing in k, so a binary search over k finds the largest feasible level in
O(log(max_level/q)) probes of O(N) each. The chunk ``ℓ`` is then poured toward that level.

``FixedLevelDispatcher`` is the baseline: n_target = max_num_batched_tokens, no estimator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .estimator import LatencyEstimator, prefill_attn_work
from .waterfill import capacity, min_level, pour

_EPS = 1e-9  # relative slack so that a level hitting τ exactly (budget profile) counts as feasible


@dataclass
class StepState:
    """Tentative per-rank state of the step being planned (Alg. 1's D̃, P and A_p)."""

    combined: list[int]  # n_d^r + n_p^r per rank
    prefill: list[int]  # n_p^r per rank
    decode_time: float = 0.0  # T_D of the resident decodes (fixed within the step, per layer)
    prefill_work: float = 0.0  # Σ ℓ_i(c_i + (ℓ_i+1)/2) of chunks accepted so far (ℓ_i in whole tiles times c_i)
    prefill_kv: int = 0  # Σ (c_i + ℓ_i) of chunks accepted so far (KV their attention reads)
    chunks: list[tuple[int, int]] = field(default_factory=list)  # accepted (ℓ_i, c_i)
    has_decode: bool = False  # the step carries decode tokens (a chunk co-batches with them: κ)

    @classmethod
    def from_decodes(cls, decode_tokens: list[int], decode_time: float) -> "StepState":
        return cls(list(decode_tokens), [0] * len(decode_tokens), decode_time, has_decode=any(decode_tokens))

    def commit(self, give: list[int], chunk: int, context: int, tile: int = 1) -> None:
        """Accept a chunk of ``chunk`` tokens (context ``context``) poured as ``give`` per rank (``tile``:
        the profile's ``query_tile``)."""
        for r, g in enumerate(give):
            if g:
                self.combined[r] += g
                self.prefill[r] += g
        self.prefill_work += prefill_attn_work(((chunk, context),), tile)
        self.prefill_kv += context + chunk
        self.chunks.append((chunk, context))


class WaterfillDispatcher:
    """Alg. 2: the largest TBT-safe chunk for a request and its per-rank assignment."""

    estimates = True  # levels are priced by the latency estimator (steps may stretch, calibrate)

    def __init__(self, estimator: LatencyEstimator, tbt_budget: float, quantum: int, max_level: int) -> None:
        self.estimator = estimator
        self.tbt_budget = tbt_budget * (1 + _EPS)  # τ (times the configured margin), in estimated seconds
        self._tau = self.tbt_budget
        self.step_stretch = 1.0  # this step's factor on the TBT budget (SchedulerConfig.max_step_stretch)
        self.quantum = quantum
        self.max_k = max_level // quantum  # highest level index: n_target <= q·max_k
        self.use(estimator)

    def use(self, estimator: LatencyEstimator) -> None:
        """Plan with ``estimator`` from now on (an online refit of the profile)."""
        self.estimator = estimator
        p = estimator.profile  # coefficients cached for the O(N) probe (same model as estimate())
        self._coef = (p.f_gemm.slope, p.f_gemm.intercept, p.f_comm.slope if p.num_ranks > 1 else 0.0,
                      p.f_comm.intercept if p.num_ranks > 1 else 0.0, p.f_prefill_attn.slope / p.num_ranks,
                      p.f_prefill_attn.intercept, p.alpha, p.beta, p.num_layers, p.f_prefill_kv.slope / p.num_ranks,
                      p.cobatch, p.chunk_cost)
        self.tile = p.query_tile

    def calibrate(self, scale: float) -> None:
        """Steps take ``scale`` × their estimate: the estimated time a step may use is τ / ``scale``."""
        self.tbt_budget = self._tau / scale

    def stretch(self, factor: float) -> None:
        """This step's chunks may take ``factor`` × the TBT budget (B_0, the admission's per-τ budget, keeps 1×)."""
        self.step_stretch = factor

    @property
    def step_budget(self) -> float:
        """Estimated seconds this step's chunks may use: the (calibrated) TBT budget × the step's stretch."""
        return self.tbt_budget * self.step_stretch

    # ---- probes ------------------------------------------------------------------------
    def _fill_time(self, st: StepState, level: int, context: int | None) -> tuple[int, float]:
        """Fill every rank below ``level`` up to it: (tokens added, estimated T_iter).

        ``context=None`` omits the candidate's attention work (reference budget B_0, App. E).
        Inlines ``LatencyEstimator.iteration_time`` (the tests hold the two equal).
        """
        added, max_comb, max_pre = 0, 0, 0
        for comb, pre in zip(st.combined, st.prefill):
            if comb < level:
                added += level - comb
                pre += level - comb
                comb = level
            if comb > max_comb:
                max_comb = comb
            if pre > max_pre:
                max_pre = pre
        work, kv, n_chunks = st.prefill_work, st.prefill_kv, len(st.chunks)
        if context is not None:
            work += -(-added // self.tile) * self.tile * context + added * (added + 1) / 2
            kv += context + added if added else 0
            n_chunks += 1 if added else 0
        gs, gi, cs, ci, ps, pi, alpha, beta, layers, ks, kappa, kc = self._coef
        gemm = gs * max_comb + gi if max_comb else 0.0
        t_p = cs * max_pre + ci + ps * work + pi + ks * kv + kc * n_chunks if max_pre else 0.0
        t_d = alpha * st.decode_time
        mixed = kappa if max_pre and st.has_decode else 0.0
        return added, layers * (gemm + (beta * t_p if beta * t_p > t_d else t_d) + mixed)

    def _largest_feasible_k(self, st: StepState, k_lo: int, k_hi: int, context: int | None, budget: float) -> int:
        """Largest k in (k_lo, k_hi] with a fill within ``budget``, else k_lo (k_lo itself adds nothing)."""
        lo, hi = k_lo, k_hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fill_time(st, mid * self.quantum, context)[1] <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def time_with(self, st: StepState, give: list[int], chunk: int, context: int) -> float:
        """Estimated T_iter if ``chunk`` tokens (context ``context``) were poured as ``give``."""
        max_comb = max(c + g for c, g in zip(st.combined, give))
        max_pre = max(p + g for p, g in zip(st.prefill, give))
        work = st.prefill_work + prefill_attn_work(((chunk, context),), self.tile)
        return self.estimator.iteration_time(max_comb, max_pre, work, st.decode_time,
                                             st.prefill_kv + context + chunk, st.has_decode, len(st.chunks) + 1)

    # ---- Alg. 2 ------------------------------------------------------------------------
    def reference_budget(self, st: StepState) -> int:
        """B_0 (Alg. 2 with i = ∅): residual prefill tokens this step under the TBT SLO."""
        k_lo = min(st.combined) // self.quantum
        if k_lo >= self.max_k:
            return 0
        k = self._largest_feasible_k(st, k_lo, self.max_k, None, self.tbt_budget)
        return capacity(st.combined, k * self.quantum)

    def dispatch(self, st: StepState, remaining: int, context: int) -> tuple[int, list[int]]:
        """(ℓ_i, A_i) for a request with ``remaining`` = m_i prompt tokens left, ``context`` = c_i.

        ℓ_i = 0 means the TBT-safe budget is exhausted for this request.
        """
        q, n = self.quantum, len(st.combined)
        if remaining <= 0:
            return 0, [0] * n
        k_full = -(-min_level(st.combined, remaining) // q)  # lowest level index holding all of m_i
        if k_full <= self.max_k:
            level = k_full * q
            give = pour(st.combined, remaining, level)
            if self.time_with(st, give, remaining, context) <= self.step_budget:
                return remaining, give
            k_hi = k_full - 1  # below k_full every level is filled completely (ℓ = B < m)
        else:
            k_hi = self.max_k
        k_lo = min(st.combined) // q
        if k_hi <= k_lo:
            return 0, [0] * n
        k = self._largest_feasible_k(st, k_lo, k_hi, context, self.step_budget)
        if k == k_lo:
            return 0, [0] * n
        level = k * q
        give = [level - c if c < level else 0 for c in st.combined]
        return sum(give), give


class FixedLevelDispatcher:
    """Baseline chunked prefill: n_target = ``tokens_per_rank`` every step, no estimator."""

    estimates = False  # a fixed level: nothing to stretch or calibrate
    tile = 1  # StepState's work is not priced here

    def __init__(self, tokens_per_rank: int) -> None:
        self.n_target = tokens_per_rank

    def reference_budget(self, st: StepState) -> int:
        return capacity(st.combined, self.n_target)

    def dispatch(self, st: StepState, remaining: int, context: int) -> tuple[int, list[int]]:
        chunk = min(remaining, capacity(st.combined, self.n_target))
        if chunk <= 0:
            return 0, [0] * len(st.combined)
        return chunk, pour(st.combined, chunk, self.n_target)
