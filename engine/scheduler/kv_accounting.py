"""Scheduler-side KV accounting per rank, in blocks of the instance's ``KVLayout``.

The scheduler mirrors what every rank's allocator holds, so a planned step never runs a rank out
of blocks, while KV is still taken as tokens are produced (not ``prompt + max_tokens`` up front):

  * a prefill reserves its head-sharded prompt on every rank when its first chunk is planned,
    and releases it once the transition step has run;
  * a decode holds ``ceil(context / block_size)`` blocks on its decode rank: the prompt when its
    last chunk is planned (on one rank, whose prefill and decode views are one layout, the prefill's
    blocks become the decode's: ``hands_over``; with several ranks the decode rank holds both while
    the transition step runs), then one more block each time a decode step crosses a block boundary
    (``grow_decode``). When a rank cannot grow its decodes, the scheduler preempts one
    (``Scheduler._make_room``) and its blocks come back here via ``release``;
  * with the prefix cache (``prefix``), cached blocks count as used on their rank exactly once;
    a decode holds privately only the blocks beyond the cached ones it references
    (``shared``). Unreferenced cached blocks count as free: taking blocks evicts them
    (LRU) and their hashes wait in ``evicted`` for the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv.layout import KVLayout
from .prefix_index import PrefixIndex


@dataclass
class KVAccounting:
    layout: KVLayout
    blocks_per_rank: int  # physical blocks in each rank's pool
    used: list[int] = field(default_factory=list)  # held blocks per rank
    prefill_held: dict[str, list[int]] = field(default_factory=dict)  # request -> blocks per rank
    decode_held: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (rank, own blocks)
    prefix: PrefixIndex | None = None  # the prefix cache's index (None: caching off)
    shared: dict[str, int] = field(default_factory=dict)  # request -> cached blocks its decode table starts with
    evicted: list[list[int]] = field(default_factory=list)  # per rank: hashes evicted since the last drain
    # request -> tokens its decode blocks (own + shared) hold: a decode needs a block only past this,
    # so the per-step check of every resident decode is one lookup (Scheduler._grow_decodes)
    decode_cover: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.used:
            self.used = [0] * self.layout.num_ranks
        self.evicted = self.evicted or [[] for _ in range(self.layout.num_ranks)]
        self._per_block = [self.layout.prefill_tokens_per_block(r) for r in range(self.layout.num_ranks)]

    @property
    def hands_over(self) -> bool:
        """One rank: its prefill and decode views are one layout, so a transition's decode table is its
        prefill table (engine/xp/kv.py ``hand_over``; the torch paged backend keeps one table per request)
        and no second copy of the prompt is taken."""
        return self.layout.num_ranks == 1 and self._per_block[0] == self.layout.block_size

    def free_blocks(self, rank: int) -> int:
        """Blocks a reservation on ``rank`` can take: unused ones plus evictable cached ones."""
        evictable = self.prefix.evictable(rank) if self.prefix else 0
        return self.blocks_per_rank - self.used[rank] + evictable

    def utilization(self, rank: int) -> float:
        return (self.blocks_per_rank - self.free_blocks(rank)) / self.blocks_per_rank

    def _take(self, rank: int, n: int) -> None:
        """Account ``n`` more blocks on ``rank``, evicting LRU cached blocks when the unused ones run out."""
        short = n - (self.blocks_per_rank - self.used[rank])
        if short > 0 and self.prefix is not None:
            gone = self.prefix.evict(rank, short)
            self.used[rank] -= len(gone)
            self.evicted[rank] += gone
        self.used[rank] += n

    def drain_evictions(self) -> list[list[int]]:
        """Hashes evicted per rank since the last call (the ranks free their blocks)."""
        out, self.evicted = self.evicted, [[] for _ in range(self.layout.num_ranks)]
        return out

    def prefill_need(self, prompt_len: int) -> list[int]:
        return [-(-prompt_len // per) for per in self._per_block]  # == layout.prefill_blocks(r, ...)

    def can_reserve_prefill(self, prompt_len: int) -> bool:
        return all(n <= self.free_blocks(r) for r, n in enumerate(self.prefill_need(prompt_len)))

    def reserve_prefill(self, request_id: str, prompt_len: int) -> None:
        need = self.prefill_need(prompt_len)
        for r, n in enumerate(need):
            self._take(r, n)
        self.prefill_held[request_id] = need

    def decode_need(self, context: int) -> int:
        """Blocks a decode of ``context`` tokens holds on its rank."""
        return self.layout.decode_blocks(context)

    def reserve_decode(self, request_id: str, rank: int, context: int, shared: int = 0) -> None:
        """Start holding ``context`` tokens of ``request_id`` on ``rank`` (its transition step), the
        first ``shared`` blocks of which are cached blocks it references (held by the cache)."""
        n = self.decode_need(context) - shared
        if self.hands_over:  # the prefill's blocks are the decode's from now on
            for r, held in enumerate(self.prefill_held.pop(request_id, ())):
                self.used[r] -= held
        self._take(rank, n)
        self.decode_held[request_id] = (rank, n)
        self.decode_cover[request_id] = (n + shared) * self.layout.block_size
        if shared:
            self.shared[request_id] = shared

    def to_cache(self, request_id: str, blocks: int) -> None:
        """``blocks`` of the request's private decode blocks joined the prefix cache (``used`` keeps
        counting them, now once for the cache)."""
        rank, own = self.decode_held[request_id]
        self.decode_held[request_id] = (rank, own - blocks)
        self.shared[request_id] = self.shared.get(request_id, 0) + blocks

    def growth(self, request_id: str, context: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``context`` tokens (0 if it already does)."""
        return max(0, self.decode_need(context) - self.decode_cover[request_id] // self.layout.block_size)

    def grow_decode(self, request_id: str, context: int) -> None:
        rank, held = self.decode_held[request_id]
        extra = self.growth(request_id, context)
        self._take(rank, extra)
        self.decode_held[request_id] = (rank, held + extra)
        self.decode_cover[request_id] += extra * self.layout.block_size

    def fits_alone(self, max_context: int, headroom: int = 0) -> bool:
        """Whether a request that may reach ``max_context`` tokens can always complete with the
        pool to itself: in its transition step it holds its decode KV on one rank and its
        head-sharded prompt on every rank, and after a preemption that prompt is up to
        ``max_context - 1`` tokens (the outputs so far are recomputed as prompt). On one rank
        (``hands_over``) the decode holds the prompt's own blocks: only the decode counts."""
        shard = 0 if self.hands_over else max(self.prefill_need(max(1, max_context - 1)))
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
            del self.decode_cover[request_id]
        self.shared.pop(request_id, None)
        if self.prefix is not None:
            self.prefix.release(request_id)

    def is_empty(self) -> bool:
        """Nothing held by a request (cached blocks nobody references may remain)."""
        cached = [self.prefix.size(r) for r in range(len(self.used))] if self.prefix else [0] * len(self.used)
        return (self.used == cached and not self.prefill_held and not self.decode_held
                and not (self.prefix and self.prefix.held))
