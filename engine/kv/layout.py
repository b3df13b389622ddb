"""Head partitions for Ulysses-SP and the KV-block accounting shared by scheduler and ranks.

Query heads are split into N contiguous, balanced ranges; a rank holds every KV head its query
heads read (GQA), so KV heads are split unevenly or replicated when N does not divide them
(SmolLM2: 9 q / 3 kv heads)::

    N=2:  q heads [0..4] [5..8]        -> kv heads [0,1] [1,2]   (kv head 1 replicated)
    N=4:  q heads [0..2] [3,4] [5,6] [7,8] -> kv [0] [1] [1,2] [2]

KV aliasing (paper §4): one physical pool per rank. A block holds ``block_size`` tokens of all
``num_kv_heads`` heads in the decode layout, or ``block_size * num_kv_heads // h_r`` tokens of the
rank's ``h_r`` heads in the head-sharded prefill layout. Both layouts index the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """Heads a rank owns for prefill attention: q heads ``[q_lo, q_hi)``, kv heads ``[kv_lo, kv_hi)``."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def num_q(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def num_kv(self) -> int:
        return self.kv_hi - self.kv_lo


def partition_heads(num_q_heads: int, num_kv_heads: int, num_ranks: int) -> list[HeadShard]:
    """Balanced contiguous q-head ranges per rank and the kv heads each range needs."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    return partition_head_range(HeadShard(0, num_q_heads, 0, num_kv_heads), group, num_ranks)


def partition_head_range(shard: HeadShard, group: int, parts: int) -> list[HeadShard]:
    """Split the q heads of ``shard`` into ``parts`` balanced contiguous ranges (global head ids),
    each with the kv heads its q heads read (``group`` q heads per kv head)."""
    if not 1 <= parts <= shard.num_q:
        raise ValueError(f"cannot split {shard.num_q} query heads over {parts} ranks")
    base, extra = divmod(shard.num_q, parts)
    out, lo = [], shard.q_lo
    for p in range(parts):
        hi = lo + base + (1 if p < extra else 0)
        out.append(HeadShard(lo, hi, lo // group, (hi - 1) // group + 1))
        lo = hi
    return out


@dataclass(frozen=True)
class KVLayout:
    """Block accounting for one XP instance (identical on the scheduler and on every rank)."""

    block_size: int  # tokens per block in the decode (all-heads) layout
    num_kv_heads: int  # H_kv of the model
    shards: tuple[HeadShard, ...]  # per rank

    @classmethod
    def build(cls, block_size: int, num_q_heads: int, num_kv_heads: int, num_ranks: int) -> "KVLayout":
        return cls(block_size, num_kv_heads, tuple(partition_heads(num_q_heads, num_kv_heads, num_ranks)))

    @property
    def num_ranks(self) -> int:
        return len(self.shards)

    def prefill_tokens_per_block(self, rank: int) -> int:
        """Tokens one block holds in rank's head-sharded prefill layout."""
        return self.block_size * self.num_kv_heads // self.shards[rank].num_kv

    def prefill_blocks(self, rank: int, num_tokens: int) -> int:
        per = self.prefill_tokens_per_block(rank)
        return -(-num_tokens // per)

    def decode_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
