"""Warm-up before ready: run every code path a real request hits once, before the instance serves.

Measured on 2 x H200 (llama-3.1-8b): without it the first requests after "ready" had TTFT 11-17 s,
paying for what happens on first use::

    CUDA graph capture    every bucket: done when a rank builds ``GraphedCausalLM`` (engine/runtime/cuda_graphs.py
                          ``capture_all``), i.e. before this module runs
    Triton compilation    each kernel at its first launch (the fused elementwise kernels, the KV row
                          scatter, the paged decode kernel and its split merge: one specialization each
                          per model, engine/xp/triton_decode.py)
    split-history attn    the flash calls of a chunk over a >= 16K history: timed for each partition count
                          when a rank builds ``XPAttention`` (engine/xp/ops.py ``prepare_history_attention``)
    NCCL communicators    made by torch at the first collective: the SP all-to-all of a prefill, the KV
                          gather to each decode rank at a prefill->decode transition
    first allocations     the caching allocator grows to the largest step (a chunk at the idle budget B_0)

``warm_up(core)`` drives a freshly built ``EngineCore`` through real iterations with its public
methods only (``add_request`` / ``step`` / ``has_unfinished`` / ``abort``; ``scheduler`` and
``config`` are read, never changed). Every request is synthetic (random token ids of the model's
vocabulary, ``__warmup-<i>`` ids, seeded sampling, ``ignore_eos``)::

    1 spread   B short prompts per rank with staggered max_tokens -> one prefill over all ranks, N*B
               prefill->decode transitions (worst-fit placement spreads them over every rank), then
               decode batches of B, B-1, ..., 1 on every rank; greedy, seeded-random and logprobs rows
    2 long     added once decodes are resident: a prompt longer than B_0 runs as >= 2 chunks over all
               ranks while phase 1 decodes (mixed steps); the CPU shape caps it at 24 tokens
    3 ladder   (CUDA) waves of N requests, one per rank, each decoding at one context of a ladder
               (the decode kernel's one-split and several-split paths, see ``decode_context_ladder``)
    drain      over the time budget: abort what is left; then step until the scheduler holds nothing
               and every rank's KV pool is empty again (checked; a leak raises)

The engine's own seed stream is untouched (every warm-up request carries a seed), so requests
after the warm-up get the same seeds, and tokens, as on an engine that never warmed up.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from ..sampling_params import SamplingParams

from ..config import Device
from ..contracts.request import GenerateRequest

if TYPE_CHECKING:
    from ..core import EngineCore

log = logging.getLogger(__name__)

ID_PREFIX = "__warmup-"  # request ids of the warm-up; user ids never start with it (none exist yet)
STALL_STEPS = 50  # consecutive steps that run nothing while requests wait: the scheduler stalled


def decode_context_ladder(max_context: int, split: int = 2048) -> tuple[int, ...]:
    """Decode contexts that run the paged decode kernel's two paths once: one split (24 keys) and
    several (two splits and a part; ``split``: ``DecodeKernelConfig.split_len``). The kernel compiles
    once (its tiles and splits do not depend on the context); this exercises the work list and the
    merge of several splits. Contexts above ``max_context`` are dropped."""
    return tuple(c for c in (24, 2 * split + 64) if c <= max_context)


@dataclass(frozen=True)
class WarmupShape:
    """How much warm-up: sizes of the synthetic requests and the time bound."""

    decodes_per_rank: int  # B: short requests per rank in phase 1 (decode batches B..1)
    short_prompt: int  # tokens of a phase-1 prompt
    max_prompt: int  # cap of the phase-2 prompt (also capped by the KV pool and the context)
    long_max_tokens: int  # output of the phase-2 request (1: no transition, no decode of its own)
    ladder: tuple[int, ...]  # phase-3 decode contexts (empty: no phase 3)
    time_budget_s: float  # past this no new phase or wave starts; what runs is aborted

    @classmethod
    def for_device(cls, device: Device, max_context: int = 16384) -> "WarmupShape":
        """CPU: two forward passes (nothing compiles on CPU and the CPU test suite starts many servers;
        what runs is the end-to-end path once: prefill, transitions and decodes on every rank, a mixed step).
        CUDA: decode batches 16..1 per rank, a long prompt up to 16K tokens, the context ladder."""
        if not device.has_gpus:
            return cls(decodes_per_rank=1, short_prompt=4, max_prompt=24, long_max_tokens=1, ladder=(),
                       time_budget_s=10.0)
        return cls(decodes_per_rank=16, short_prompt=8, max_prompt=16384, long_max_tokens=2,
                   ladder=decode_context_ladder(max_context), time_budget_s=120.0)


@dataclass
class WarmupReport:
    """What the warm-up ran, per code path (from the executed plans)."""

    seconds: float = 0.0
    steps: int = 0  # executed iterations
    requests: int = 0
    prefill_ranks: set[int] = field(default_factory=set)  # ranks that ran prefill tokens
    multi_chunk: bool = False  # a prompt ran as >= 2 chunks, one of them over every rank
    transition_ranks: set[int] = field(default_factory=set)  # decode ranks of prefill->decode transitions
    decode_batches: dict[int, set[int]] = field(default_factory=dict)  # rank -> decode batch sizes run
    mixed_steps: int = 0  # steps with prefill chunks and decodes together
    ladder_done: int = 0  # phase-3 waves completed
    over_budget: bool = False  # stopped early at the time budget
    stalled: list[str] = field(default_factory=list)  # requests the scheduler never advanced (then aborted)
    _chunks: dict[str, int] = field(default_factory=dict, repr=False)  # request -> steps with its chunks

    def record(self, plan, num_ranks: int) -> None:
        self.steps += 1
        ranks_of: dict[str, set[int]] = {}
        for s in plan.prefill:
            ranks_of.setdefault(s.request_id, set()).add(s.rank)
            self.prefill_ranks.add(s.rank)
        for rid, ranks in ranks_of.items():
            self._chunks[rid] = self._chunks.get(rid, 0) + 1
            if self._chunks[rid] >= 2 and len(ranks) == num_ranks:
                self.multi_chunk = True
        self.transition_ranks |= {t.decode_rank for t in plan.transitions}
        for r, ids in enumerate(plan.decode):
            if ids:
                self.decode_batches.setdefault(r, set()).add(len(ids))
        if plan.prefill and any(plan.decode):
            self.mixed_steps += 1

    def missing(self, num_ranks: int) -> list[str]:
        """Code paths the warm-up did not reach (empty when it covered all of them)."""
        every = set(range(num_ranks))
        out = []
        if self.prefill_ranks != every:
            out.append(f"prefill on ranks {sorted(every - self.prefill_ranks)}")
        if not self.multi_chunk:
            out.append("a multi-chunk prefill over all ranks")
        if self.transition_ranks != every:
            out.append(f"transitions to ranks {sorted(every - self.transition_ranks)}")
        if set(self.decode_batches) != every or any(len(b) < 2 for b in self.decode_batches.values()):
            out.append("decodes of several batch sizes on every rank")
        if not self.mixed_steps:
            out.append("a step mixing chunks and decodes")
        return out

    def describe(self, num_ranks: int) -> str:
        batches = {r: sorted(b) for r, b in sorted(self.decode_batches.items())}
        miss = self.missing(num_ranks)
        return (f"{self.steps} steps, {self.requests} requests in {self.seconds:.2f} s"
                f"{' (time budget reached)' if self.over_budget else ''}; decode batches per rank {batches}, "
                f"{self.mixed_steps} mixed steps, {self.ladder_done} context waves"
                + (f"; not reached: {', '.join(miss)}" if miss else "; every path reached")
                + (f"; THE SCHEDULER STALLED (planned nothing for {STALL_STEPS} steps) on {', '.join(self.stalled)}"
                   if self.stalled else ""))


class _Driver:
    """Adds synthetic requests and steps the engine, recording each executed plan."""

    def __init__(self, core: EngineCore, report: WarmupReport, deadline: float, seed: int) -> None:
        self.core, self.report, self.deadline = core, report, deadline
        self.n = core.config.num_ranks
        self.vocab = core.source.config.vocab_size
        self.rng = random.Random(seed)
        self.live: dict[str, int] = {}  # unfinished request -> prompt tokens
        self._last_step = -1

    def add(self, prompt_len: int, max_tokens: int) -> str:
        i = self.report.requests
        rid = f"{ID_PREFIX}{i}"
        kind = i % 3  # greedy / seeded random (top-p, top-k) / greedy with top logprobs
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                                temperature=0.8 if kind == 1 else 0.0, top_p=0.9 if kind == 1 else 1.0,
                                top_k=50 if kind == 1 else -1, logprobs=2 if kind == 2 else None)
        prompt = [self.rng.randrange(self.vocab) for _ in range(prompt_len)]
        self.core.add_request(GenerateRequest(rid, prompt, params))
        self.live[rid] = prompt_len
        self.report.requests += 1
        return rid

    def step(self) -> bool:
        """One ``core.step()``; True if it executed a plan."""
        for out in self.core.step():
            if out.finished:
                self.live.pop(out.request_id, None)
        plan = self.core.last_plan
        if plan is None or plan.step == self._last_step:
            return False
        self._last_step = plan.step
        self.report.record(plan, self.n)
        return True

    def over(self) -> bool:
        if time.monotonic() > self.deadline:
            self.report.over_budget = True
        return self.report.over_budget

    def run_until(self, done: Callable[[], bool]) -> bool:
        """Step until ``done()``; False when the time budget ran out first or the scheduler stalled
        (its waiting requests are then aborted and named in ``report.stalled``)."""
        idle = 0
        while not done():
            if self.over():
                return False
            idle = 0 if self.step() else idle + 1
            if idle >= STALL_STEPS:
                self.report.stalled += [f"{rid} ({n} prompt tokens)" for rid, n in sorted(self.live.items())]
                self.abort_all()
                return False
        return True

    def abort_all(self) -> None:
        for rid in sorted(self.live):
            self.core.abort(rid)
        self.live.clear()


def warm_up(core: EngineCore, shape: WarmupShape | None = None, *, seed: int = 0,
            rank_kv_blocks_held: Callable[[], Sequence[int]] | None = None,
            logger: logging.Logger | None = None) -> WarmupReport:
    """Warm ``core`` up (module docstring); it must hold no request. Returns what ran.

    ``rank_kv_blocks_held``: per rank, physical KV blocks still held (e.g. ``RayExecutor.kv_blocks_held``);
    checked to be all zero at the end. Raises RuntimeError if anything is left behind."""
    logger = logger or log
    if core.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine (requests are in flight)")
    cfg, sched = core.config, core.scheduler
    shape = shape or WarmupShape.for_device(cfg.device)
    n = cfg.num_ranks
    t0 = time.monotonic()
    report = WarmupReport()
    d = _Driver(core, report, t0 + shape.time_budget_s, seed)
    b0 = sched.last_budget  # B_0: prefill tokens an idle step takes (the instance's largest step)
    kv_tokens = sched.kv.blocks_per_rank * cfg.block_size
    # a request's decode reservation and its prompt's shards must fit one rank's pool at once
    longest = max(1, min(core.max_model_len, kv_tokens // 2) - 2 * cfg.block_size)
    # phase 1: B short prompts per rank, staggered lengths of output -> decode batches B..1 on each rank
    b = max(1, min(shape.decodes_per_rank, sched.config.max_num_seqs // n))
    short = max(1, min(shape.short_prompt, b0 // (n * b), longest - 2 * b))  # all in one step: batch B at once
    for i in range(n * b):
        d.add(short, 2 + 2 * (i // n))  # the j-th request of each rank decodes 2j+1 steps
    # phase 2: once decodes are resident, a prompt past the idle budget B_0 (two chunks or more)
    long_len = max(1, min(shape.max_prompt, b0 + sched.config.quantum, longest - 4))
    if d.run_until(lambda: any(sched.decode_context_per_rank()) or not d.live):
        d.add(long_len, shape.long_max_tokens)
        d.run_until(lambda: not d.live)
    # phase 3: waves of one request per rank, decoding at each context of the ladder
    for c in shape.ladder:
        if c + 2 > longest or d.over():
            break
        for _ in range(n):
            d.add(c - 2, 2)
        if not d.run_until(lambda: not d.live):
            break
        report.ladder_done += 1
    d.abort_all()
    _drain(d, core, rank_kv_blocks_held)
    report.seconds = time.monotonic() - t0
    # CPU shapes skip what only matters on CUDA (a multi-chunk prompt costs seconds there): no warning
    quiet = (not cfg.on_cuda or not report.missing(n)) and not report.stalled
    (logger.info if quiet else logger.warning)("warm-up: %s", report.describe(n))
    return report


def _drain(d: _Driver, core: EngineCore, rank_kv_blocks_held: Callable[[], Sequence[int]] | None) -> None:
    """Step until the scheduler holds nothing (frees reach the ranks); check that nothing leaked."""
    for _ in range(10_000):
        if not core.has_unfinished():
            break
        d.step()
    else:
        raise RuntimeError("warm-up: the engine did not drain")
    sched = core.scheduler
    sched.check_invariants()
    if not sched.kv.is_empty():
        raise RuntimeError(f"warm-up: the scheduler still accounts KV blocks {sched.kv.used}")
    if rank_kv_blocks_held is not None:
        held = list(rank_kv_blocks_held())
        if any(held):
            raise RuntimeError(f"warm-up: ranks still hold KV blocks {held} after every request ended")
