"""The profiler's samples and the fit that turns them into an ``EstimatorProfile``; plain Python
(scipy for the optional joint refinement), so the online refit and ``conflux profile --fit-only``
need neither torch nor the engine.

Three families of whole-iteration times (``engine/profiling/harness.py`` measures them; a served
step log sorts into the same families):

    decode family     T/L = f_GEMM(max_r n_d^r) + f_D(max_r Σ c_i)        (α = 1: nothing to contend with)
    prefill family    T/L = f_GEMM(max_r n_p^r) + f_comm(max_r n_p^r) + f_P(ℓ(c+(ℓ+1)/2)/N)   (β = 1)
    heterogeneous     half fit α, β, half are held out for the reported MAPE

The components are separated by regression across these families of *whole* iterations, so the
fitted functions also carry what a real iteration pays beyond the four operators (embedding, norms,
LM head, sampling, Python). The constant both families pay lands in f_GEMM's intercept, the rest of
each family's constant in f_D's / f_P's; the GEMM slope comes from the decode family, the comm slope
from the prefill family (none at N = 1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..estimator import Affine, BatchLoad, EstimatorProfile, prefill_attn_work, prefill_kv_tokens
from .fit import BatchSample, fit_contention, fit_linear2, profile_mape


@dataclass
class Measurements:
    """Raw samples of the three families (seconds per whole iteration); JSON round-trip."""

    decode: list[BatchSample] = field(default_factory=list)
    prefill: list[BatchSample] = field(default_factory=list)
    hetero: list[BatchSample] = field(default_factory=list)

    def to_json(self, path) -> None:
        def enc(s: BatchSample) -> dict:
            return {"seconds": s.seconds, **{k: list(map(list, v)) if k == "prefill_chunks" else list(v)
                                            for k, v in asdict(s.load).items()}}
        Path(path).write_text(json.dumps({k: [enc(s) for s in getattr(self, k)]
                                          for k in ("decode", "prefill", "hetero")}))

    @classmethod
    def from_json(cls, path) -> "Measurements":
        """A profiler's raw samples (``to_json``); FileNotFoundError, or a ValueError naming the file and
        what is wrong (not JSON, a missing family or sample field)."""
        from ...util.json_file import read_json_file

        raw = read_json_file(path)
        families = ("decode", "prefill", "hetero")
        missing = [k for k in families if not isinstance(raw, dict) or not isinstance(raw.get(k), list)]
        if missing:
            raise ValueError(f"{path}: not a profiler's raw samples (`conflux profile --raw-out`): no list "
                             f"{', '.join(missing)}")
        return cls(*([_sample(path, f"{k}[{i}]", d) for i, d in enumerate(raw[k])] for k in families))

    @classmethod
    def from_samples(cls, samples: list[BatchSample], max_per_family: int | None = None) -> "Measurements":
        """Served steps sorted into the three families (``step_log.py``'s ``family``), each thinned
        evenly to at most ``max_per_family`` steps (the contention grid's cost grows with them)."""
        from .step_log import family

        fams: dict[str, list[BatchSample]] = {"decode": [], "prefill": [], "hetero": []}
        for s in samples:
            fams[family(s.load)].append(s)
        for k, xs in fams.items():
            if max_per_family is not None and len(xs) > max_per_family:
                fams[k] = [xs[i * len(xs) // max_per_family] for i in range(max_per_family)]
        return cls(fams["decode"], fams["prefill"], fams["hetero"])

    @classmethod
    def from_step_log(cls, path, max_per_family: int = 400) -> "Measurements":
        """A served step log (``step_log.py``) as ``from_samples``."""
        from .step_log import read_step_log

        return cls.from_samples(read_step_log(path), max_per_family)

    @classmethod
    def load(cls, path) -> "Measurements":
        """A profiler's raw JSON, or a served step log (``.jsonl``, or gzipped ``.jsonl.gz``)."""
        return cls.from_step_log(path) if str(path).endswith((".jsonl", ".jsonl.gz")) else cls.from_json(path)

    def __add__(self, other: "Measurements") -> "Measurements":
        return Measurements(self.decode + other.decode, self.prefill + other.prefill, self.hetero + other.hetero)


def _sample(path, where: str, d: object) -> BatchSample:
    """One raw sample of ``path`` (``where``: its family and index, for the error)."""
    try:
        load = BatchLoad(tuple(int(x) for x in d["prefill_tokens"]), tuple(int(x) for x in d["decode_tokens"]),
                         tuple(int(x) for x in d["decode_context"]),
                         tuple((int(c[0]), int(c[1])) for c in d["prefill_chunks"]))
        return BatchSample(load, float(d["seconds"]))
    except KeyError as e:
        raise ValueError(f"{path}: sample {where}: missing field {e}") from None
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: sample {where}: not a sample ({e})") from None


def fit_measurements(m: Measurements, *, model: str, hardware: str, num_ranks: int, num_layers: int,
                     meta: dict | None = None, query_tile: int = 1) -> EstimatorProfile:
    """Separate the components across the families (module docstring), then α, β and held-out MAPE.
    ``query_tile``: the profile's (``prefill_attn_work``): 128 for the flash kernels on CUDA, 1 on CPU."""
    L = num_layers
    # decode family: T/L = γ·n + a_D·W + const
    n = [max(s.load.decode_tokens) for s in m.decode]
    w = [max(s.load.decode_context) for s in m.decode]
    gamma, a_d, const = fit_linear2(n, w, [s.seconds / L for s in m.decode])
    # prefill family: T/L − γ·n_p = a_comm·n_p + a_P·W/N + const_P
    npx = [max(s.load.prefill_tokens) for s in m.prefill]
    wp = [prefill_attn_work(s.load.prefill_chunks, query_tile) / num_ranks for s in m.prefill]
    resid = [s.seconds / L - gamma * x for s, x in zip(m.prefill, npx)]
    wts = [(L / s.seconds) ** 2 for s in m.prefill]  # relative to the whole measured time
    if num_ranks > 1:
        a_comm, a_p, const_p = fit_linear2(npx, wp, resid, weights=wts)
    else:
        a_comm, (a_p, _, const_p) = 0.0, fit_linear2(wp, [0.0] * len(wp), resid, weights=wts)
    # The constant every iteration pays goes to f_GEMM; what only decode / prefill steps pay
    # (e.g. sampling rows, the SP path) to the intercepts of f_D / f_P.
    shared = min(const, const_p)
    base = EstimatorProfile(model=model, hardware=hardware, num_ranks=num_ranks, num_layers=L,
                            f_gemm=Affine(gamma, shared), f_prefill_attn=Affine(a_p, const_p - shared),
                            f_decode_attn=Affine(a_d, const - shared), f_comm=Affine(a_comm, 0.0),
                            query_tile=query_tile)
    train, held = m.hetero[0::2], m.hetero[1::2]
    alpha, beta = fit_contention(base, train) if train else (1.0, 1.0)
    fitted = replace(base, alpha=alpha, beta=beta)
    refined = refine_jointly(fitted, m.decode + m.prefill + train)
    method = "family-wise regression + contention grid"
    if refined is not None and profile_mape(refined, m.decode + m.prefill + train) < \
            profile_mape(fitted, m.decode + m.prefill + train):
        fitted, method = refined, "joint bounded least squares (started from the family-wise fit)"
    info = dict(meta or {})
    info.update({
        "fit": method,
        "samples": {"decode": len(m.decode), "prefill": len(m.prefill), "hetero": len(m.hetero)},
        "mape_percent_decode_family": profile_mape(fitted, m.decode) if m.decode else None,
        "mape_percent_prefill_family": profile_mape(fitted, m.prefill) if m.prefill else None,
        "mape_percent_hetero_train": profile_mape(fitted, train) if train else None,
        "mape_percent_hetero_heldout": profile_mape(fitted, held) if held else None,
        "mape_percent_hetero_heldout_alpha_beta_1": (profile_mape(replace(fitted, alpha=1.0, beta=1.0), held)
                                                     if held else None),
    })
    return replace(fitted, meta=info)


_PARAMS = ("f_gemm", "f_decode_attn", "f_prefill_attn", "f_comm")


def refine_jointly(profile: EstimatorProfile, samples: list[BatchSample], max_factor: float = 4.0
                   ) -> EstimatorProfile | None:
    """All coefficients at once (bounded least squares on relative error, scipy), started from the
    family-wise fit; None when scipy is missing or the solver fails."""
    try:
        import numpy as np
        from scipy.optimize import least_squares
    except ImportError:
        return None
    if len(samples) < 12:
        return None
    N, L = profile.num_ranks, profile.num_layers
    n = np.array([max(p + d for p, d in zip(s.load.prefill_tokens, s.load.decode_tokens)) for s in samples], float)
    npre = np.array([max(s.load.prefill_tokens) for s in samples], float)
    wd = np.array([max((c for c, k in zip(s.load.decode_context, s.load.decode_tokens) if k), default=0)
                   for s in samples], float)
    hasd = np.array([any(s.load.decode_tokens) for s in samples], float)
    wp = np.array([prefill_attn_work(s.load.prefill_chunks, profile.query_tile) / N for s in samples], float)
    wkv = np.array([prefill_kv_tokens(s.load.prefill_chunks) / N for s in samples], float)
    y = np.array([s.seconds for s in samples])
    comm_on = 1.0 if N > 1 else 0.0

    mixed = (npre > 0) & (hasd > 0)  # steps that co-batch both phases pay κ
    nch = np.array([len(s.load.prefill_chunks) for s in samples], float)  # κ_c: per chunk
    varied = len(set(nch[npre > 0])) > 1  # κ_c is only told from f_P's intercept by steps of several counts
    if not varied:
        nch = np.zeros_like(nch)

    def unpack(x):
        return x[0:2], x[2:4], x[4:6], x[6:8], x[8], x[9], x[10], x[11], x[12]

    def predict(x):
        g, d, p, c, alpha, beta, kv, kappa, kc = unpack(x)
        gemm = np.where(n > 0, g[0] * n + g[1], 0.0)
        t_p = np.where(npre > 0, comm_on * (c[0] * npre + c[1]) + p[0] * wp + p[1] + kv * wkv + kc * nch, 0.0)
        t_d = np.where(hasd > 0, d[0] * wd + d[1], 0.0)
        return L * (gemm + np.maximum(beta * t_p, alpha * t_d) + kappa * mixed)

    x0 = np.array([v for name in _PARAMS for v in (getattr(profile, name).slope, getattr(profile, name).intercept)]
                  + [profile.alpha, profile.beta, profile.f_prefill_kv.slope, profile.cobatch, profile.chunk_cost])
    t = float(y.mean()) / L  # typical per-layer seconds: the scale of each parameter when it starts at 0
    typical = [t / max(1.0, float(v.mean())) for v in (n, wd, wp, npre)]
    floor = np.array([typical[0], t, typical[1], t, typical[2], t, typical[3], t, 1.0, 1.0,
                      t / max(1.0, float(wkv.mean())), t, t])
    scale = np.maximum(np.abs(x0), floor)
    lo = np.array([0.0] * 8 + [1.0, 1.0, 0.0, 0.0, 0.0])
    hi = np.array([np.inf] * 8 + [max_factor, max_factor, np.inf, np.inf, np.inf])  # α, β: contention, not free scale factors
    try:
        sol = least_squares(lambda z: predict(z * scale) / y - 1.0, np.clip(x0, lo, hi) / scale,
                            bounds=(lo / scale, hi / scale), loss="soft_l1", f_scale=0.05)
        if not sol.success:
            return None
    except Exception:  # noqa: BLE001 - a failed refinement keeps the family-wise fit
        return None
    x = sol.x * scale
    fs = {name: Affine(float(x[2 * i]), float(x[2 * i + 1])) for i, name in enumerate(_PARAMS)}
    if N == 1:
        fs["f_comm"] = Affine(0.0, 0.0)  # unused (and unconstrained) without SP
    return replace(profile, **fs, alpha=float(x[8]), beta=float(x[9]), f_prefill_kv=Affine(float(x[10]), 0.0),
                   cobatch=float(x[11]) if mixed.any() else 0.0,  # κ: only where mixed steps were measured
                   chunk_cost=float(x[12]) if varied else profile.chunk_cost)
