"""Which attention heads a device holds, for decode (its TP shard) and for prefill (its SP shard).

A logical rank is a TP group of ``k`` devices (paper App. C; ``k = 1`` is plain XP). Device
``(r, t)`` (logical rank ``r``, TP index ``t``) holds TP shard ``t`` of the heads for the shared
linears and for decode attention; for prefill, TP shard ``t`` is split again over the ``N``
logical ranks (Ulysses SP across the devices with the same ``t``)::

    SmolLM2 (9 q / 3 kv heads, group 3), N=2 logical ranks x TP2:
      TP shards:        t=0: q [0..4] kv [0,1]          t=1: q [5..8] kv [1,2]
      SP sub-shards t=0: r=0: q [0..2] kv [0]  r=1: q [3,4] kv [1]
                    t=1: r=0: q [5,6] kv [1]   r=1: q [7,8] kv [2]

Ranges are contiguous and balanced; a shard holds every KV head its query heads read, so KV
heads are split unevenly or replicated when the counts do not divide (``kv_layout.partition_heads``
is the ``k = 1`` case over all heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kv.layout import HeadShard, partition_head_range, partition_heads


@dataclass(frozen=True)
class DeviceHeads:
    """Head ownership of one device. All ids are global head ids of the model."""

    group: int  # query heads per KV head (GQA)
    tp_shard: HeadShard  # heads of the device's TP shard: its q/k/v projections and decode KV
    sp_shards: tuple[HeadShard, ...]  # prefill sub-shards of ``tp_shard`` over the N logical ranks
    rank: int  # logical rank r (index into sp_shards)

    @classmethod
    def build(cls, num_q_heads: int, num_kv_heads: int, num_ranks: int, tp_size: int = 1,
              rank: int = 0, tp_rank: int = 0) -> "DeviceHeads":
        tp = partition_heads(num_q_heads, num_kv_heads, tp_size)[tp_rank]
        group = num_q_heads // num_kv_heads
        return cls(group, tp, tuple(partition_head_range(tp, group, num_ranks)), rank)

    @property
    def sp_shard(self) -> HeadShard:
        return self.sp_shards[self.rank]

    @property
    def num_q(self) -> int:
        """q heads in the device's projections (and in the ``q`` the attention seam receives)."""
        return self.tp_shard.num_q

    @property
    def num_kv(self) -> int:
        """kv heads in the device's projections and in its decode-layout KV."""
        return self.tp_shard.num_kv

    def q_slice(self, shard: HeadShard) -> slice:
        """Columns of the device-local q heads that ``shard`` covers."""
        return slice(shard.q_lo - self.tp_shard.q_lo, shard.q_hi - self.tp_shard.q_lo)

    def kv_slice(self, shard: HeadShard) -> slice:
        """Columns of the device-local kv heads that ``shard`` covers."""
        return slice(shard.kv_lo - self.tp_shard.kv_lo, shard.kv_hi - self.tp_shard.kv_lo)

    def kv_of_q(self, shard: HeadShard) -> list[int]:
        """For each q head of ``shard``: index of its kv head within ``shard``'s kv heads."""
        return [h // self.group - shard.kv_lo for h in range(shard.q_lo, shard.q_hi)]

    def kv_owner(self, kv_head: int) -> int:
        """Logical rank whose prefill sub-shard supplies ``kv_head`` at a transition (first holder)."""
        for r, s in enumerate(self.sp_shards):
            if s.kv_lo <= kv_head < s.kv_hi:
                return r
        raise ValueError(f"kv head {kv_head} is not in TP shard {self.tp_shard}")
