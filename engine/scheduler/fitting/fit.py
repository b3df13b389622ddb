"""Fitting the latency model (App. D, 'Fitting') from measured samples. Pure Python.

1. Each base function f ∈ {f_GEMM, f_P, f_D, f_comm} is fitted by (weighted) least squares on
   samples measured in isolation: (workload x, per-layer seconds y).
2. α, β ≥ 1 are fitted on heterogeneous batches (the whole iteration measured, T_iter) by
   minimizing the squared relative error of Eq. 2-6 over a grid refined three times.
3. ``mape`` reports the mean absolute percentage error on held-out batches.

``relative=True`` weights each sample by 1/y², i.e. fits relative error, which is what MAPE
measures and keeps the short (small-workload) samples from being swamped by the long ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..estimator import Affine, BatchLoad, EstimatorProfile, LatencyEstimator


@dataclass(frozen=True)
class BatchSample:
    """One heterogeneous batch and its measured iteration time (seconds, all layers)."""

    load: BatchLoad
    seconds: float


def fit_affine(xs: Sequence[float], ys: Sequence[float], relative: bool = True) -> Affine:
    """Least-squares y ≈ slope·x + intercept; both clamped at >= 0 (latencies do not shrink)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"need >= 2 paired samples, got {len(xs)} x and {len(ys)} y")
    w = [1.0 / (y * y) if relative and y > 0 else 1.0 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    if sxx == 0:
        return Affine(0.0, max(0.0, my))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
    slope = max(0.0, sxy / sxx)
    intercept = my - slope * mx
    if intercept < 0:  # refit through the origin
        slope = max(0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs)))
        intercept = 0.0
    return Affine(slope, intercept)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError("mape needs equally long, non-empty sequences")
    return 100.0 * sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)


def profile_mape(profile: EstimatorProfile, samples: Sequence[BatchSample]) -> float:
    est = LatencyEstimator(profile)
    return mape([est.estimate(s.load).total for s in samples], [s.seconds for s in samples])


def _rel_sq_error(profile: EstimatorProfile, samples: Sequence[BatchSample]) -> float:
    est = LatencyEstimator(profile)
    return sum(((est.estimate(s.load).total - s.seconds) / s.seconds) ** 2 for s in samples)


def fit_contention(profile: EstimatorProfile, samples: Sequence[BatchSample], max_factor: float = 4.0,
                   grid: int = 16, rounds: int = 4) -> tuple[float, float]:
    """(α, β) in [1, max_factor]² minimizing the squared relative error on ``samples``."""
    if not samples:
        raise ValueError("fit_contention needs heterogeneous batch samples")
    lo_a, hi_a, lo_b, hi_b = 1.0, max_factor, 1.0, max_factor
    best = (float("inf"), 1.0, 1.0)
    for _ in range(rounds):
        step_a, step_b = (hi_a - lo_a) / grid, (hi_b - lo_b) / grid
        for i in range(grid + 1):
            a = lo_a + i * step_a
            for j in range(grid + 1):
                b = lo_b + j * step_b
                err = _rel_sq_error(replace(profile, alpha=a, beta=b), samples)
                if err < best[0]:
                    best = (err, a, b)
        _, a, b = best
        lo_a, hi_a = max(1.0, a - step_a), min(max_factor, a + step_a)
        lo_b, hi_b = max(1.0, b - step_b), min(max_factor, b + step_b)
    return best[1], best[2]


@dataclass
class ComponentSamples:
    """Isolated measurements, per layer: (workload, seconds) pairs for each base function.

    gemm: (rank-local tokens n, s); prefill_attn: (per-rank causal work W = Σℓ(c+(ℓ+1)/2)/N, s);
    decode_attn: (aggregate decode context on a rank, s); comm: (largest prefill shard, s).
    """

    gemm: list[tuple[float, float]]
    prefill_attn: list[tuple[float, float]]
    decode_attn: list[tuple[float, float]]
    comm: list[tuple[float, float]]


def fit_profile(samples: ComponentSamples, batches: Sequence[BatchSample], *, model: str, hardware: str,
                num_ranks: int, num_layers: int, meta: dict | None = None) -> EstimatorProfile:
    """All four base functions, then α, β on ``batches``; MAPE on those batches goes to meta."""

    def fit(pairs: list[tuple[float, float]]) -> Affine:
        return fit_affine([x for x, _ in pairs], [y for _, y in pairs])

    comm = fit(samples.comm) if num_ranks > 1 and len(samples.comm) >= 2 else Affine(0.0, 0.0)
    base = EstimatorProfile(model=model, hardware=hardware, num_ranks=num_ranks, num_layers=num_layers,
                            f_gemm=fit(samples.gemm), f_prefill_attn=fit(samples.prefill_attn),
                            f_decode_attn=fit(samples.decode_attn), f_comm=comm)
    alpha, beta = fit_contention(base, batches) if batches else (1.0, 1.0)
    fitted = replace(base, alpha=alpha, beta=beta)
    info = dict(meta or {})
    if batches:
        info["fit_mape_percent"] = profile_mape(fitted, batches)
    return replace(fitted, meta=info)


def fit_linear2(x1: Sequence[float], x2: Sequence[float], ys: Sequence[float], relative: bool = True,
                weights: Sequence[float] | None = None) -> tuple[float, float, float]:
    """Least-squares y ≈ b1·x1 + b2·x2 + c with b1, b2, c >= 0 (a negative term is dropped, refit).

    For separating two workloads measured together (e.g. GEMM tokens and decode context in
    decode-only iterations).
    """
    if not (len(x1) == len(x2) == len(ys)) or len(ys) < 3:
        raise ValueError(f"need >= 3 samples of (x1, x2, y), got {len(x1)}, {len(x2)}, {len(ys)}")
    w = list(weights) if weights is not None else [1.0 / (y * y) if relative and y > 0 else 1.0 for y in ys]
    cols = {"b1": list(x1), "b2": list(x2), "c": [1.0] * len(ys)}
    active = ["b1", "b2", "c"]
    while active:
        coef = _wls([cols[k] for k in active], ys, w)
        if coef is not None and all(v >= 0 for v in coef):
            out = dict(zip(active, coef))
            return out.get("b1", 0.0), out.get("b2", 0.0), out.get("c", 0.0)
        if coef is None:
            active.pop(0)
        else:
            active.pop(min(range(len(coef)), key=lambda i: coef[i]))  # drop the most negative
    return 0.0, 0.0, 0.0


def _wls(cols: list[list[float]], ys: Sequence[float], w: Sequence[float]) -> list[float] | None:
    """Weighted normal equations, solved by Gaussian elimination; None if singular."""
    k = len(cols)
    a = [[sum(wi * ci * cj for wi, ci, cj in zip(w, cols[i], cols[j])) for j in range(k)] for i in range(k)]
    b = [sum(wi * ci * y for wi, ci, y in zip(w, cols[i], ys)) for i in range(k)]
    diag = [abs(a[i][i]) for i in range(k)]
    for i in range(k):
        p = max(range(i, k), key=lambda r: abs(a[r][i]))
        if abs(a[p][i]) <= 1e-10 * max(diag[i], 1e-300):  # collinear columns
            return None
        a[i], a[p], b[i], b[p] = a[p], a[i], b[p], b[i]
        for r in range(i + 1, k):
            f = a[r][i] / a[i][i]
            for c in range(i, k):
                a[r][c] -= f * a[i][c]
            b[r] -= f * b[i]
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        x[i] = (b[i] - sum(a[i][c] * x[c] for c in range(i + 1, k))) / a[i][i]
    return x
