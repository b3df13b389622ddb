"""Measures the latency model's components on the real engine (the fit is ``scheduler/fitting/samples.py``).

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

import math
import random
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..contracts.step import DecodeTransition, PrefillSlice, StepInput, StepPlan, StepResult
from ..scheduler.estimator import BatchLoad, EstimatorProfile
from ..scheduler.fitting.fit import BatchSample
from ..scheduler.fitting.samples import Measurements, fit_measurements
from ..scheduler.waterfill import pour

if TYPE_CHECKING:
    from ..config import Device


# Bump when the engine's iteration times change materially (kernels, graphs, sampling): 'auto'
# only uses profiles fitted on this revision (meta["engine_revision"]), older ones are stale.
# Revision 2: the profiles shipped before it priced a 2048-token step per rank of
# Llama-8B on 2 x H200 at 300 ms (roofline 51 ms), so the scheduler under-filled every step.
# Revision 3: a step that samples nothing now returns when its device work is done;
# before, the profiler's samples held the previous setup step's tail (a 32-token chunk over a 32K
# history timed at 228 ms, 33 ms now), and profiles gained the co-batch term κ.
# Revision 4: prefill chunks over histories >= 16K attend them split (split_history.py),
# up to 3.5x faster in attention; revision-3 profiles overprice them.
# Revision 5: the split's partition count is timed per query-block count on the device,
# graphs cover steps of up to 1,024 tokens in buckets of 128 above 256, and profiles count a chunk's
# queries in whole 128-row tiles over its history (``query_tile``).
# Revision 6: a chunk's history attention runs in cuDNN where it timed faster than flash
# (fixed 16K-key partitions; 1.4-2.4x faster per layer over 40-98K histories).
# Revision 7: chunks of more than 2,048 tokens over a >= 16K history take cuDNN too, in
# pieces of 2,048 queries (1.3-1.9x faster in attention than flash for 2-8K-token chunks).
# Revision 8: on CUDA all prefill chunks of a step attend in one FlashInfer paged call per layer (a step
# no longer costs more per chunk), and profiles gain κ_c (``chunk_cost``) from heterogeneous batches of
# up to 8 chunks.
ENGINE_REVISION = 8


class StepExecutor(Protocol):
    def execute(self, step_input: StepInput) -> StepResult: ...


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


@dataclass(frozen=True)
class AfterDecode:
    """``_Harness.run_after_decode``'s timings (host clock, seconds)."""

    launch_s: float  # the second step's ``launch``
    decode_read_s: float  # from the decode step's launch until its tokens were read
    pair_s: float  # from the decode step's launch until the second step's tokens were read


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

    def _next_input(self, prefill: list[PrefillSlice], decode: list[list[str]],
                    transitions: list[DecodeTransition] = ()):
        """The next step's input (what is queued to send goes with it), the decodes' contexts advanced."""
        plan = StepPlan(self.step_id, list(prefill), [list(d) for d in decode], list(transitions), self._to_free)
        inp = self._make_input(plan, self.new, self.first)
        self.step_id += 1
        self.new, self.first, self._to_free = [], {}, []
        for ids in decode:
            for rid in ids:
                self.context[rid] += 1
        return inp

    def run(self, prefill: list[PrefillSlice], decode: list[list[str]],
            transitions: list[DecodeTransition] = ()) -> tuple[float, StepResult]:
        inp = self._next_input(prefill, decode, transitions)
        t0 = time.perf_counter()
        res = self.ex.execute(inp)
        return time.perf_counter() - t0, res

    def run_ahead(self, decode: list[list[str]], steps: int) -> float:
        """Seconds per step of ``steps`` decode-only steps, each launched before the previous one's tokens
        are read (``RankWorker.launch`` / ``finish``, as the pipelined engine and the rank actors run
        them; the last step's tail included). Needs an in-process rank (``self.ex.worker``)."""
        worker = self.ex.worker
        unread = []
        t0 = time.perf_counter()
        for _ in range(steps):
            unread.append(worker.launch(self._next_input([], decode)))
            if len(unread) > 1:
                worker.finish(unread.pop(0))
        worker.finish(unread.pop())
        return (time.perf_counter() - t0) / steps

    def run_after_decode(self, decode: list[list[str]], prompt_tokens: int, with_decodes: bool,
                         ahead: bool, profiler=None) -> AfterDecode:
        """A decode-only step of ``decode``, then a step of a new request's first ``prompt_tokens``
        (registered with that step, as a served request is) and, ``with_decodes``, the same decodes
        again; the second launched before the first one's tokens are read (``ahead``, as ranks that
        launch ahead run them) or after; ``profiler`` (a ``cProfile.Profile``) records the second launch.
        Needs an in-process rank (``self.ex.worker``)."""
        worker = self.ex.worker
        t0 = time.perf_counter()
        first = worker.launch(self._next_input([], decode))
        if not ahead:
            worker.finish(first)
            read = time.perf_counter() - t0
        rid = self.new_request(prompt_tokens + 1, "p")  # never its final chunk: samples nothing
        second_input = self._next_input(self.slices(rid, 0, prompt_tokens),
                                        decode if with_decodes else [[] for _ in range(self.n)])
        if profiler is not None:
            profiler.enable()
        t1 = time.perf_counter()
        second = worker.launch(second_input)
        launch = time.perf_counter() - t1
        if profiler is not None:
            profiler.disable()
        if ahead:
            worker.finish(first)
            read = time.perf_counter() - t0
        worker.finish(second)
        self.free([rid])
        return AfterDecode(launch, read, time.perf_counter() - t0)

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
        previous sample's frees. A chunk at context 0 has no setup step that would carry them: before
        revision 3 its timed step did, ~10-20 ms of host work on one H200 that no served step pays."""
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


# ---- wiring to the engine ------------------------------------------------------------------
def device_query_tile(device: Device) -> int:
    """The profile's ``query_tile`` on ``device``: the flash kernels' query block on CUDA, none on CPU."""
    from ..xp.split_history import QUERY_BLOCK

    return QUERY_BLOCK if device.has_gpus else 1


def engine_adapters():
    """(make_request, make_input) for the engine's ``StepInput`` / ``NewRequest`` (greedy)."""
    from ..sampling_params import SamplingParams
    from ..contracts.step import NewRequest, StepInput

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
    from ..loader import resolve_model

    mcfg = resolve_model(config.model).config
    own = executor is None
    if executor is None:  # the served instance's executor (one device: the XP backend of one rank)
        from ..runtime.executor import instance_executor
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
                            meta={"kind": "measured", "engine_revision": ENGINE_REVISION, "device": config.device_name,
                                  "dtype": config.dtype,
                                  "tp_size": config.tp_size, "xp_mode": config.xp_mode,
                                  "grid": {k: v for k, v in grid.__dict__.items()},
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
