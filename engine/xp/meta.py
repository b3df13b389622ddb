r"""Per-step XP attention metadata, built identically on every device from the ``StepPlan``.

Local token order on logical rank r (what the model's shared linears see)::

    x_r = [ prefill slices on r, in plan order | decode tokens of plan.decode[r] ]
           \____ SP path (Ulysses) ____/          \__ local path (own KV) __/

In ``uniform-sp`` mode decode tokens also take the SP path (their KV stays head-sharded).
After the first all-to-all a device holds the SP tokens of all ranks for its heads, grouped by
source rank: ``[tokens of r0 | tokens of r1 | ...]``; ``SPSegment.token_idx`` picks one
request's tokens out of that array in position order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..contracts.step import CacheInsert, PrefixHit, StepPlan


@dataclass(frozen=True)
class SPSegment:
    """One request's tokens in the SP path this step: positions ``[start, end)``."""

    request_id: str
    start: int
    end: int
    token_idx: torch.Tensor  # [end - start] int64: rows of the received token array, in order


@dataclass(frozen=True)
class Transition:
    request_id: str
    decode_rank: int
    prompt_len: int  # end of the final chunk: head-sharded KV [start, prompt_len) is gathered
    start: int = 0  # positions the decode rank already holds (a prefix-cache hit)


@dataclass
class XPStepMeta:
    """What XP attention needs for one step on one device (same SP part on every device)."""

    rank: int  # logical rank of this device
    sp_counts: list[int]  # SP tokens contributed by each logical rank (n_p^r [+ n_d^r])
    sp_segments: list[SPSegment]  # every request's SP work this step (identical on all ranks)
    local_decode: list[str]  # requests decoding locally on this rank, in local token order
    transitions: list[Transition] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)  # prefix-cache hashes this device frees first
    prefix_hits: list[PrefixHit] = field(default_factory=list)  # scattered to prefill views before the step
    cache_inserts: list[CacheInsert] = field(default_factory=list)  # applied after the step
    retained: list[CacheInsert] = field(default_factory=list)  # finished requests' blocks, cached before frees

    @property
    def num_local_sp(self) -> int:
        return self.sp_counts[self.rank]

    @property
    def has_sp(self) -> bool:
        return sum(self.sp_counts) > 0


def build_step_meta(plan: StepPlan, rank: int, uniform_sp: bool,
                    sp_decode_pos: dict[str, int] | None = None) -> XPStepMeta:
    """Derive the step's attention metadata for logical ``rank``.

    ``sp_decode_pos``: uniform-sp only, position of each decoding request's new token (its
    head-sharded KV length, known to every device).
    """
    n = plan.num_ranks()
    counts = [0] * n
    pieces: dict[str, list[tuple[int, int, int]]] = {}  # rid -> [(start, end, global row)]
    local_rows: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]  # per rank (rid, s, e)
    for s in plan.prefill:
        local_rows[s.rank].append((s.request_id, s.start, s.end))
    if uniform_sp:
        for r, ids in enumerate(plan.decode):
            for rid in ids:
                p = sp_decode_pos[rid]
                local_rows[r].append((rid, p, p + 1))
    offset = 0
    for r in range(n):
        for rid, s, e in local_rows[r]:
            pieces.setdefault(rid, []).append((s, e, offset + counts[r]))
            counts[r] += e - s
        offset += counts[r]
    segments = []
    for rid, ps in pieces.items():
        ps.sort()
        for (s0, e0, _), (s1, _, _) in zip(ps, ps[1:]):
            if e0 != s1:
                raise ValueError(f"request {rid}: slices [{s0},{e0}) and [{s1},..) are not contiguous")
        idx = torch.cat([torch.arange(g, g + e - s) for s, e, g in ps])
        segments.append(SPSegment(rid, ps[0][0], ps[-1][1], idx))
    ends = {seg.request_id: seg.end for seg in segments}
    transitions = [] if uniform_sp else [
        Transition(t.request_id, t.decode_rank, ends[t.request_id], t.start) for t in plan.transitions]
    local_decode = [] if uniform_sp else list(plan.decode[rank])
    evicted = list(plan.evicted[rank]) if plan.evicted else []
    return XPStepMeta(rank, counts, segments, local_decode, transitions, list(plan.finished), evicted,
                      list(plan.prefix_hits), list(plan.cache_inserts), list(plan.retained))
