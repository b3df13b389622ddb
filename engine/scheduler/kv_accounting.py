"""Scheduler-side KV reservations per rank, in blocks of the instance's ``KVLayout``.

Reservation is conservative, so a planned step can never run out of blocks on a rank:
  * a prefill reserves its head-sharded prompt on every rank when its first chunk is planned;
  * a decode reserves ``prompt + max_new_tokens`` on its decode rank when its last chunk is planned;
  * the prefill shards are released once the transition step has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv_layout import KVLayout


@dataclass
class KVAccounting:
    layout: KVLayout
    blocks_per_rank: int  # physical blocks in each rank's pool
    used: list[int] = field(default_factory=list)  # reserved blocks per rank
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

    def decode_need(self, max_context: int) -> int:
        return self.layout.decode_blocks(max_context)

    def reserve_decode(self, request_id: str, rank: int, max_context: int) -> None:
        n = self.decode_need(max_context)
        self.used[rank] += n
        self.decode_held[request_id] = (rank, n)

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
