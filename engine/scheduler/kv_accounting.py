"""Scheduler-side KV accounting per rank, in blocks of the instance's ``KVLayout``.

The scheduler mirrors what every rank's allocator holds, so a planned step never runs a rank out
of blocks, while KV is still taken as tokens are produced (not ``prompt + max_tokens`` up front):

  * a prefill reserves its head-sharded prompt on every rank when its first chunk is planned,
    and releases it once the transition step has run;
  * a decode holds ``ceil(context / block_size)`` blocks on its decode rank: the prompt when its
    last chunk is planned, then one more block each time a decode step crosses a block boundary
    (``grow_decode``). When a rank cannot grow its decodes, the scheduler preempts one
    (``Scheduler._make_room``) and its blocks come back here via ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv_layout import KVLayout


@dataclass
class KVAccounting:
    layout: KVLayout
    blocks_per_rank: int  # physical blocks in each rank's pool
    used: list[int] = field(default_factory=list)  # held blocks per rank
    prefill_held: dict[str, list[int]] = field(default_factory=dict)  # request -> blocks per rank
    decode_held: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (rank, blocks)

    def __post_init__(self) -> None:
        if not self.used:
            self.used = [0] * self.layout.num_ranks
        self._per_block = [self.layout.prefill_tokens_per_block(r) for r in range(self.layout.num_ranks)]

    def free_blocks(self, rank: int) -> int:
        return self.blocks_per_rank - self.used[rank]

    def utilization(self, rank: int) -> float:
        return self.used[rank] / self.blocks_per_rank

    def prefill_need(self, prompt_len: int) -> list[int]:
        return [-(-prompt_len // per) for per in self._per_block]  # == layout.prefill_blocks(r, ...)

    def can_reserve_prefill(self, prompt_len: int) -> bool:
        return all(n <= self.free_blocks(r) for r, n in enumerate(self.prefill_need(prompt_len)))

    def reserve_prefill(self, request_id: str, prompt_len: int) -> None:
        need = self.prefill_need(prompt_len)
        for r, n in enumerate(need):
            self.used[r] += n
        self.prefill_held[request_id] = need

    def decode_need(self, context: int) -> int:
        """Blocks a decode of ``context`` tokens holds on its rank."""
        return self.layout.decode_blocks(context)

    def reserve_decode(self, request_id: str, rank: int, context: int) -> None:
        """Start holding ``context`` tokens of ``request_id`` on ``rank`` (its transition step)."""
        n = self.decode_need(context)
        self.used[rank] += n
        self.decode_held[request_id] = (rank, n)

    def growth(self, request_id: str, context: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``context`` tokens (0 if it already does)."""
        _, held = self.decode_held[request_id]
        return max(0, self.decode_need(context) - held)

    def grow_decode(self, request_id: str, context: int) -> None:
        rank, held = self.decode_held[request_id]
        extra = self.growth(request_id, context)
        self.used[rank] += extra
        self.decode_held[request_id] = (rank, held + extra)

    def fits_alone(self, max_context: int, headroom: int = 0) -> bool:
        """Whether a request that may reach ``max_context`` tokens can always complete with the
        pool to itself: in its transition step it holds its decode KV on one rank and its
        head-sharded prompt on every rank, and after a preemption that prompt is up to
        ``max_context - 1`` tokens (the outputs so far are recomputed as prompt)."""
        shard = max(self.prefill_need(max(1, max_context - 1)))
        return self.decode_need(max_context) + shard + headroom <= self.blocks_per_rank

    def max_context_alone(self, headroom: int = 0) -> int:
        """The longest ``max_context`` for which ``fits_alone`` holds (0 if none)."""
        lo, hi = 0, self.blocks_per_rank * self.layout.block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits_alone(mid, headroom) else (lo, mid - 1)
        return lo

    def release_prefill(self, request_id: str) -> None:
        for r, n in enumerate(self.prefill_held.pop(request_id, ())):
            self.used[r] -= n

    def release(self, request_id: str) -> None:
        self.release_prefill(request_id)
        if request_id in self.decode_held:
            rank, n = self.decode_held.pop(request_id)
            self.used[rank] -= n

    def is_empty(self) -> bool:
        return not any(self.used) and not self.prefill_held and not self.decode_held
