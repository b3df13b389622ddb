"""Measures the latency model's components on the real engine and fits an ``EstimatorProfile``.

``conflux profile`` drives an XP executor (any N, CPU or GPU) with hand-made ``StepPlan``s and
times whole iterations (``executor.execute``, which returns only after every rank has sampled):

    decode family     decode-only steps, n_d^r decodes per rank with mixed contexts
                      T/L = f_GEMM(max_r n_d^r) + f_D(max_r Σ c_i)        (α = 1: nothing to contend with)
    prefill family    one chunk ℓ after context c, poured evenly, no decodes
                      T/L = f_GEMM(max_r n_p^r) + f_comm(max_r n_p^r) + f_P(ℓ(c+(ℓ+1)/2)/N)   (β = 1)
    heterogeneous     random decode subsets + 1-2 random prefill chunks together: half fit α, β,
                      half are held out for the reported MAPE

Deviation from the paper (App. D profiles each operator standalone): the components are separated
by regression across these families of *whole* iterations, so the fitted functions also carry
what a real iteration pays beyond the four operators (embedding, norms, LM head, sampling,
Python), which is what the scheduler must budget. The constant both families pay lands in
f_GEMM's intercept, the rest of each family's constant in f_D's / f_P's; the GEMM slope comes
from the decode family, the comm slope from the prefill family (none at N = 1).

Decodes come from a pool built once (each request prefilled and transitioned to its rank);
a step decodes any subset of the pool. Prefill chunks use fresh requests that are freed after.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from .plan import DecodeTransition, PrefillSlice, StepPlan, StepResult
from .scheduler.estimator import Affine, BatchLoad, EstimatorProfile, prefill_attn_work, prefill_kv_tokens
from .scheduler.fit import BatchSample, fit_contention, fit_linear2, profile_mape
from .scheduler.waterfill import pour


class StepExecutor(Protocol):
    def execute(self, step_input: Any) -> StepResult: ...


@dataclass
class ProfileGrid:
    """What to measure. ``cpu()`` / ``gpu()`` give sensible ranges; sizes are per instance."""

    decode_batch: list[int]  # decodes per rank in decode-family steps
    decode_context: list[int]  # context classes of the decode pool (cycled)
    prefill_chunk: list[int]  # ℓ of prefill-family chunks (whole instance)
    prefill_context: list[int]  # c before the chunk
    hetero_batches: int = 200  # heterogeneous batches (half fit α, β; half held out)
    repeats: int = 3  # measurements per point; the fastest is kept (robust to preemption)
    hetero_repeats: int = 2  # likewise per heterogeneous batch (each repeat re-runs its setup)
    warmup: int = 3  # unmeasured steps first
    setup_tokens_per_step: int = 8192  # prefill tokens per rank per unmeasured setup step
    time_budget_s: float = 540.0  # stop measuring heterogeneous batches past this
    max_chunks: int = 8  # prefill chunks per heterogeneous batch: 1 to this many (κ_c is fitted on them)
    seed: int = 0

    @classmethod
    def cpu(cls) -> "ProfileGrid":
        return cls(decode_batch=[1, 4, 16], decode_context=[64, 256, 512], prefill_chunk=[16, 64, 256],
                   prefill_context=[0, 256], hetero_batches=40, repeats=2, setup_tokens_per_step=1024,
                   time_budget_s=300)

    @classmethod
    def gpu(cls) -> "ProfileGrid":
        """Paper §8.5 ranges, capped so one H200 holds the pool and a run fits a 10-minute call:
        chunks 32-8K, prefill contexts 0-16K, decode contexts 1K-8K, up to 64 decodes per rank."""
        return cls(decode_batch=[1, 8, 16, 32, 64], decode_context=[1024, 2048, 4096, 8192],
                   prefill_chunk=[32, 256, 1024, 4096, 8192], prefill_context=[0, 4096, 16384],
                   hetero_batches=120, repeats=2, hetero_repeats=1, time_budget_s=240)

    def pool_size(self) -> int:
        return max(self.decode_batch)


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
        from .util.json_file import read_json_file

        raw = read_json_file(path)
        families = ("decode", "prefill", "hetero")
        missing = [k for k in families if not isinstance(raw, dict) or not isinstance(raw.get(k), list)]
        if missing:
            raise ValueError(f"{path}: not a profiler's raw samples (`conflux profile --raw-out`): no list "
                             f"{', '.join(missing)}")
        return cls(*([_sample(path, f"{k}[{i}]", d) for i, d in enumerate(raw[k])] for k in families))

    @classmethod
    def from_samples(cls, samples: list[BatchSample], max_per_family: int | None = None) -> "Measurements":
        """Served steps sorted into the three families (``engine/step_log.py``'s ``family``), each thinned
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
        """A served step log (``engine/step_log.py``) as ``from_samples``."""
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


class _Progress:
    def __init__(self, total: int, label: str, stream=sys.stderr) -> None:
        self.total, self.label, self.done, self.stream, self.t0 = total, label, 0, stream, time.monotonic()

    def tick(self) -> None:
        self.done += 1
        width = 30
        fill = int(width * self.done / max(1, self.total))
        self.stream.write(f"\r{self.label:10s} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                          f"{time.monotonic() - self.t0:6.1f}s")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


class _Harness:
    """Hand-made plans on an executor: setup prefills, a decode pool, timed steps."""

    def __init__(self, executor: StepExecutor, num_ranks: int, vocab: int, rng: random.Random,
                 make_request, make_input, setup_tokens: int) -> None:
        self.ex, self.n, self.vocab, self.rng = executor, num_ranks, vocab, rng
        self.setup_tokens = setup_tokens  # per rank per unmeasured setup step
        self._make_request, self._make_input = make_request, make_input
        self.step_id = 0
        self.new: list[Any] = []
        self.first: dict[str, int] = {}
        self.context: dict[str, int] = {}  # decode pool: request -> current context c_i
        self.pool: list[list[str]] = [[] for _ in range(num_ranks)]
        self._to_free: list[str] = []
        self._uid = 0

    def _rid(self, kind: str) -> str:
        self._uid += 1
        return f"{kind}{self._uid}"

    def run(self, prefill: list[PrefillSlice], decode: list[list[str]],
            transitions: list[DecodeTransition] = ()) -> tuple[float, StepResult]:
        plan = StepPlan(self.step_id, list(prefill), [list(d) for d in decode], list(transitions), self._to_free)
        inp = self._make_input(plan, self.new, self.first)
        self.step_id += 1
        self.new, self.first, self._to_free = [], {}, []
        t0 = time.perf_counter()
        res = self.ex.execute(inp)
        dt = time.perf_counter() - t0
        for ids in decode:
            for rid in ids:
                self.context[rid] += 1
        return dt, res

    def new_request(self, prompt_len: int, kind: str) -> str:
        rid = self._rid(kind)
        self.new.append(self._make_request(rid, [self.rng.randrange(self.vocab) for _ in range(prompt_len)]))
        return rid

    def slices(self, rid: str, start: int, end: int, loads: list[int] | None = None) -> list[PrefillSlice]:
        loads = loads or [0] * self.n
        give = pour(loads, end - start, max(loads) + end - start)
        out, pos = [], start
        for r, g in enumerate(give):
            if g:
                out.append(PrefillSlice(rid, r, pos, pos + g))
                pos += g
        return out

    def prefill_upto(self, rid: str, start: int, end: int) -> None:
        """Unmeasured chunks [start, end) of ``rid`` (not its final chunk)."""
        per = self.n * self.setup_tokens
        for lo in range(start, end, per):
            self.run(self.slices(rid, lo, min(end, lo + per)), [[] for _ in range(self.n)])

    def free(self, rids: list[str]) -> None:
        self._to_free.extend(rids)

    def settle(self) -> None:
        """Run what a timed step must not carry, in an untimed step of its own: the registration of
        new requests (their prompts reach the ranks with the first step that names them) and the
        previous sample's frees. A chunk at context 0 has no setup step that would carry them: until
        2026-12-01 its timed step did, ~10-20 ms of host work on one H200 that no served step pays."""
        if self.new or self._to_free:
            self.run([], [[] for _ in range(self.n)])

    def build_pool(self, per_rank: int, contexts: list[int], progress: _Progress | None) -> None:
        """``per_rank`` resident decodes on every rank, contexts cycling through ``contexts``."""
        for r in range(self.n):
            for j in range(per_rank):
                c = contexts[(j + r) % len(contexts)]
                rid = self.new_request(c, "d")
                self.prefill_upto(rid, 0, c - 1)
                _, res = self.run(self.slices(rid, c - 1, c), [[] for _ in range(self.n)],
                                  [DecodeTransition(rid, r)])
                self.first[rid] = res.sampled[rid]  # decode input of its first decode step
                self.context[rid] = c
                self.pool[r].append(rid)
                if progress:
                    progress.tick()
        self.run([], [list(p) for p in self.pool])  # deliver every first token once

    def load_of(self, prefill: list[PrefillSlice], decode: list[list[str]], chunks) -> BatchLoad:
        pre = [0] * self.n
        for s in prefill:
            pre[s.rank] += s.num_tokens
        return BatchLoad(tuple(pre), tuple(len(d) for d in decode),
                         tuple(sum(self.context[i] for i in d) for d in decode), tuple(chunks))


MIN_HETERO_BATCHES = 12  # measured past the time budget if need be: half of them give the held-out MAPE


def measure(executor: StepExecutor, grid: ProfileGrid, num_ranks: int, vocab: int, make_request, make_input,
            log=print) -> Measurements:
    """Run the three families on ``executor``; returns the raw samples (seconds, all layers)."""
    rng = random.Random(grid.seed)
    h = _Harness(executor, num_ranks, vocab, rng, make_request, make_input, grid.setup_tokens_per_step)
    out = Measurements()
    t_start = time.monotonic()
    h.build_pool(grid.pool_size(), grid.decode_context, _Progress(num_ranks * grid.pool_size(), "pool"))
    for _ in range(grid.warmup):
        h.run([], [p[: max(1, len(p) // 2)] for p in h.pool])
    prog = _Progress(len(grid.decode_batch) * grid.repeats, "decode")
    for nb in grid.decode_batch:
        for _ in range(grid.repeats):
            dec = [rng.sample(p, min(nb, len(p))) for p in h.pool]
            load = h.load_of([], dec, ())
            dt = min(h.run([], dec)[0] for _ in range(grid.repeats))  # contexts grow by < repeats
            out.decode.append(BatchSample(load, dt))
            prog.tick()
    prog = _Progress(len(grid.prefill_chunk) * len(grid.prefill_context), "prefill")
    empty = [[] for _ in range(num_ranks)]
    for ell in grid.prefill_chunk:  # one sample per point: the fastest of its repeats (each sets up c again)
        for c in grid.prefill_context:
            out.prefill.append(_measure_chunks(h, [(ell, c)], empty, grid.repeats))
            prog.tick()
    prog = _Progress(grid.hetero_batches, "hetero")
    lo, hi = min(grid.prefill_chunk), max(grid.prefill_chunk)
    for i in range(grid.hetero_batches):
        if i >= MIN_HETERO_BATCHES and time.monotonic() - t_start > grid.time_budget_s:
            log(f"\ntime budget {grid.time_budget_s}s reached after {i} heterogeneous batches")
            break
        chunks = _hetero_chunks(rng, grid, lo, hi)
        dec = [rng.sample(p, rng.randint(1, len(p))) for p in h.pool]
        out.hetero.append(_measure_chunks(h, chunks, dec, grid.hetero_repeats))
        prog.tick()
    return out


def _hetero_chunks(rng: random.Random, grid: ProfileGrid, lo: int, hi: int) -> list[tuple[int, int]]:
    """A heterogeneous step's chunks (ℓ, c): 1 to ``grid.max_chunks`` of them (served steps of bursty
    traffic hold several), lengths log-uniform in [lo, hi / count] so the step stays of profiled size."""
    k = rng.randint(1, grid.max_chunks)
    top = max(lo, hi // k)
    return [(int(math.exp(rng.uniform(math.log(lo), math.log(top)))), rng.choice(grid.prefill_context))
            for _ in range(k)]


def _measure_chunks(h: _Harness, chunks: list[tuple[int, int]], decode: list[list[str]],
                    repeats: int = 1) -> BatchSample:
    """Fastest of ``repeats`` identical steps, each on fresh requests set up to context c."""
    samples = [_measure_chunks_once(h, chunks, decode) for _ in range(repeats)]
    return min(samples, key=lambda s: s.seconds)


def _measure_chunks_once(h: _Harness, chunks: list[tuple[int, int]], decode: list[list[str]]) -> BatchSample:
    """Set up fresh requests to context c, then time one step running every chunk (+ ``decode``)."""
    rids = []
    for ell, c in chunks:
        rid = h.new_request(c + ell + 1, "p")  # never the final chunk: no transition needed
        h.prefill_upto(rid, 0, c)
        rids.append(rid)
    h.settle()
    loads = [len(d) for d in decode]
    slices = []
    for rid, (ell, c) in zip(rids, chunks):
        s = h.slices(rid, c, c + ell, loads)
        for x in s:
            loads[x.rank] += x.num_tokens
        slices += s
    load = h.load_of(slices, decode, chunks)
    dt, _ = h.run(slices, decode)
    h.free(rids)
    return BatchSample(load, dt)


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


# ---- wiring to the engine ------------------------------------------------------------------
def device_query_tile(device: str) -> int:
    """The profile's ``query_tile`` on ``device``: the flash kernels' query block on CUDA, none on CPU."""
    from .xp.split_history import QUERY_BLOCK

    return QUERY_BLOCK if str(device).startswith("cuda") else 1


def engine_adapters():
    """(make_request, make_input) for the engine's ``StepInput`` / ``NewRequest`` (greedy)."""
    from .sampling_params import SamplingParams
    from .plan import NewRequest, StepInput

    params = SamplingParams(temperature=0.0, max_tokens=None)

    def make_request(rid: str, prompt: list[int]):
        return NewRequest(rid, prompt, params, 0)

    def make_input(plan: StepPlan, new: list, first: dict):
        return StepInput(plan, list(new), dict(first))

    return make_request, make_input


def profile_engine(config, grid: ProfileGrid, hardware: str, executor: StepExecutor | None = None,
                   log=print, raw_out: str | None = None, query_tile: int | None = None) -> EstimatorProfile:
    """Measure ``config``'s instance (``EngineConfig``) and fit its profile (``query_tile``: default
    ``device_query_tile``)."""
    from .loader import resolve_model
    from .profile_store import ENGINE_REVISION

    mcfg = resolve_model(config.model).config
    own = executor is None
    if executor is None:  # the served instance's executor (one device: the XP backend of one rank)
        from .runtime.executor import instance_executor
        executor = instance_executor(config)
    try:
        m = measure(executor, grid, config.num_ranks, mcfg.vocab_size, *engine_adapters(), log=log)
    finally:
        if own and hasattr(executor, "shutdown"):
            executor.shutdown()
    if raw_out:
        m.to_json(raw_out)
    return fit_measurements(m, model=config.model, hardware=hardware, num_ranks=config.num_ranks,
                            num_layers=mcfg.num_hidden_layers,
                            query_tile=query_tile or device_query_tile(config.device),
                            meta={"kind": "measured", "engine_revision": ENGINE_REVISION, "device": config.device,
                                  "dtype": config.dtype,
                                  "tp_size": config.tp_size, "xp_mode": config.xp_mode,
                                  "grid": {k: v for k, v in grid.__dict__.items()},
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
