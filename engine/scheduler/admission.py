"""TTFT-aware admission: Moore–Hodgson under a fixed-capacity surrogate (paper §6.4, Alg. 4, App. G).

Requests are taken in EDF order (by TTFT deadline d_i). Before d_i the instance can prefill at
most K_i = max(0, ⌊(d_i − t)/τ⌋·B_0) tokens (B_0: this step's reference budget, τ: TBT SLO, the
iteration length). Keeping a running total C of the admitted requests' remaining prefill m_i,
whenever C > K_i the admitted request with the largest m_i is dropped (max-heap). Because K_i is
nondecreasing in EDF order this maximizes the number of on-time requests under the surrogate
(Moore 1968). The scheduler then serves the admitted set in EDF order and backfills the dropped
ones in SJF order.

``EDFQueue`` keeps the pending requests sorted by deadline with their m_i and d_i in parallel
plain lists, updated incrementally, so that one admission pass is a single tight loop::

    reqs:      [r7,   r2,   r9,   ...]   sorted by (ttft_deadline, seq)
    deadline:  [0.91, 0.95, 1.20, ...]   d_i
    remaining: [6400, 310,  22000, ...]  m_i (updated when a chunk runs)

Beyond the paper's surrogate, m_i may be counted in *step tokens* (``PrefillWork``): B_0 is the
budget of a step whose chunk attends to nothing, but a chunk over a long history fits fewer tokens
under τ (its attention reads the history), so a 24K-token prompt takes ≈ 2× the steps its raw
token count suggests on one H200. ``PrefillWork`` charges each request its remaining tokens plus
its attention and KV reads, converted into the GEMM tokens they cost, from the same fitted profile
the waterfill dispatch uses. With raw counts Moore–Hodgson admitted long prompts it could not
finish, and the short requests queued behind them came late.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from .estimator import EstimatorProfile, prefill_attn_work
from .requests import SchedRequest


class DeadlineUnattainable(RuntimeError):
    """A request refused at arrival (``SchedulerConfig.reject_unattainable``): Moore–Hodgson admission over
    the queue with it drops it, so under the current load its first token cannot come within the TTFT SLO.
    Picklable (it crosses Ray to the HTTP ingress, which answers 503 ``slo_unattainable``)."""

    def __init__(self, request_id: str, ttft_slo_s: float, backlog_s: float) -> None:
        super().__init__(f"request {request_id}: its TTFT SLO of {ttft_slo_s:g} s cannot be met under the current "
                         f"load ({backlog_s:.1f} s of prefill queued)")
        self.request_id = request_id
        self.ttft_slo_s = ttft_slo_s  # the objective it would miss
        self.backlog_s = backlog_s  # seconds of prefill queued ahead at the reference budget (≈ when to retry)

    def __reduce__(self):
        return (DeadlineUnattainable, (self.request_id, self.ttft_slo_s, self.backlog_s))

_IDX_BITS = 24  # heap keys pack (m, index) into one int: −(m << 24 | index)


def moore_hodgson_indices(remaining: Sequence[int], deadlines: Sequence[float], b0: int, now: float,
                          tau: float) -> list[int]:
    """Indices (into the EDF-sorted inputs) of the requests Moore–Hodgson rejects, in drop order.

    O(R log R). Among equal m_i the later-deadline request is dropped first. Requests whose
    deadline is less than one iteration away (K_i = 0) are all rejected without heap work.
    """
    n = len(remaining)
    start = bisect.bisect_left(deadlines, now + tau)  # K_i = 0 before this index
    while start > 0 and (deadlines[start - 1] - now) // tau >= 1:  # float rounding at the edge
        start -= 1
    rejected = [i for i in range(start) if remaining[i] > 0]
    heap: list[int] = []
    push, pushpop = heapq.heappush, heapq.heappushpop
    total = 0
    for i in range(start, n):
        m = remaining[i]
        total += m
        key = -((m << _IDX_BITS) | i)
        if total > ((deadlines[i] - now) // tau) * b0:
            top = -pushpop(heap, key)  # the largest m among the admitted and i
            total -= top >> _IDX_BITS
            rejected.append(top & ((1 << _IDX_BITS) - 1))
        else:
            push(heap, key)
    return rejected


def moore_hodgson(edf: Sequence[SchedRequest], b0: int, now: float, tau: float
                  ) -> tuple[list[SchedRequest], list[SchedRequest]]:
    """(admitted in EDF order, rejected in drop order) for ``edf`` sorted by ``ttft_deadline``."""
    rej = moore_hodgson_indices([r.remaining_prefill for r in edf], [r.ttft_deadline for r in edf],
                                b0, now, tau)
    dropped = set(rej)
    return [r for i, r in enumerate(edf) if i not in dropped], [edf[i] for i in rej]


def on_time_feasible(remaining: Sequence[int], deadlines: Sequence[float], b0: int, now: float,
                     tau: float) -> bool:
    """Whether all given requests meet their deadlines under the surrogate (EDF prefix check)."""
    total = 0
    for m, d in sorted(zip(remaining, deadlines), key=lambda x: x[1]):
        total += m
        slots = (d - now) // tau
        if total > (slots * b0 if slots > 0 else 0):
            return False
    return True


@dataclass(frozen=True)
class PrefillWork:
    """m̃_i: a request's remaining prefill in the units of B_0 (tokens of a step whose chunk attends to
    nothing). With m = m_i prompt tokens left after c = p_i − m_i computed (or cached) ones::

        m̃ = m + attn · m·(c + (m+1)/2) + kv · (chunks·(c + m/2) + m/2),  chunks = ⌈m / chunk_tokens⌉

    where ``attn`` = β·a_P / (γ + a_comm) and ``kv`` = β·k_KV / (γ + a_comm) convert the chunks' causal
    token pairs and the KV their attention reads (Eq. 9 and its k_KV extension) into GEMM tokens. Where
    decode attention hides prefill attention (max(β·T_P, α·T_D)) this overcounts: a conservative surrogate."""

    attn: float  # GEMM tokens per causal token pair
    kv: float  # GEMM tokens per KV token a chunk's attention reads
    chunk_tokens: int  # a chunk's size on an idle instance (B_0 there), for the chunk count
    tile: int = 1  # the profile's query_tile

    @classmethod
    def from_profile(cls, profile: EstimatorProfile, chunk_tokens: int) -> "PrefillWork":
        per_token = profile.f_gemm.slope + (profile.f_comm.slope if profile.num_ranks > 1 else 0.0)
        if per_token <= 0:
            return cls(0.0, 0.0, max(chunk_tokens, 1))
        return cls(profile.beta * profile.f_prefill_attn.slope / per_token,
                   profile.beta * profile.f_prefill_kv.slope / per_token, max(chunk_tokens, 1), profile.query_tile)

    def __call__(self, req: SchedRequest) -> int:
        m = req.remaining_prefill
        if m <= 0:
            return 0
        c = req.prompt_len - m
        chunks = -(-m // self.chunk_tokens)
        extra = self.attn * prefill_attn_work(((m, c),), self.tile) + self.kv * (chunks * (c + m / 2) + m / 2)
        return m + int(round(extra))


def raw_tokens(req: SchedRequest) -> int:
    """m_i as the paper counts it: prompt tokens left (the surrogate without ``PrefillWork``)."""
    return req.remaining_prefill


class EDFQueue:
    """Pending prefills sorted by (ttft_deadline, seq), with d_i and m_i as parallel lists; ``work``
    gives a request's m_i (default: its remaining prompt tokens; ``PrefillWork``: in step tokens)."""

    def __init__(self, work: Callable[[SchedRequest], int] = raw_tokens) -> None:
        self.work = work
        self.given_up: set[str] = set()  # ids Moore–Hodgson rejected in its latest pass (admission)
        self.reqs: list[SchedRequest] = []
        self.deadline: list[float] = []
        self.remaining: list[int] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def _index(self, req: SchedRequest) -> int:
        i = bisect.bisect_left(self.reqs, (req.ttft_deadline, req.seq), key=lambda r: (r.ttft_deadline, r.seq))
        if i >= len(self.reqs) or self.reqs[i] is not req:
            raise KeyError(f"request {req.request_id} not in the EDF queue")
        return i

    def add(self, req: SchedRequest) -> None:
        i = bisect.bisect_right(self.reqs, (req.ttft_deadline, req.seq), key=lambda r: (r.ttft_deadline, r.seq))
        self.reqs.insert(i, req)
        self.deadline.insert(i, req.ttft_deadline)
        self.remaining.insert(i, self.work(req))

    def remove(self, req: SchedRequest) -> None:
        i = self._index(req)
        del self.reqs[i], self.deadline[i], self.remaining[i]

    def rework(self, work: Callable[[SchedRequest], int]) -> None:
        """Count m_i with ``work`` from now on (a refitted profile), every queued request's at once."""
        self.work = work
        self.remaining = [work(r) for r in self.reqs]

    def refresh(self, req: SchedRequest) -> None:
        """Re-read m_i of ``req`` after its prefill progressed."""
        self.remaining[self._index(req)] = self.work(req)

    def admission(self, b0: int, now: float, tau: float) -> list[int]:
        """Moore–Hodgson rejected indices for the current queue (their ids stay in ``given_up``)."""
        rejected = moore_hodgson_indices(self.remaining, self.deadline, b0, now, tau)
        self.given_up = {self.reqs[i].request_id for i in rejected}
        return rejected

    def rejects(self, req: SchedRequest, b0: int, now: float, tau: float) -> bool:
        """Whether Moore–Hodgson over the current queue (``req`` in it) drops ``req``."""
        i = self._index(req)
        return i in self.admission(b0, now, tau)
