"""The instance's load summary for the global router (DESIGN §3: instance -> router).

The dataclass is a contract (``engine/contracts/cluster.py``) that router, engine and simulator
share; this module builds it from a scheduler's state.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..contracts.cluster import InstanceLoad

from .kv_accounting import KVAccounting


class LoadSource(Protocol):
    """What the summary reads of a scheduler (``Scheduler`` is one)."""

    kv: KVAccounting
    waiting: Sequence  # requests whose prefill is not finished
    decoding: Sequence  # requests resident in decode
    prefill_capacity: float  # prefill tokens per second

    def queued_prefill_tokens(self) -> int: ...

    def decode_context_per_rank(self) -> list[int]: ...


def instance_load(sched: LoadSource) -> InstanceLoad:
    """Summary of ``sched`` now: queued prefill tokens (not yet prefilled, partly computed included;
    under Moore–Hodgson admission only the admitted requests', which a new arrival queues behind),
    resident decode context, KV use, and the instance's prefill capacity (tokens/s)."""
    kv = sched.kv
    return InstanceLoad(
        queued_prefill_tokens=sched.queued_prefill_tokens(),
        inflight_prefill_tokens=0,  # the router adds what it sent since this report
        num_waiting=len(sched.waiting),
        num_decoding=len(sched.decoding),
        decode_context_tokens=sum(sched.decode_context_per_rank()),
        kv_utilization=sum(map(kv.utilization, range(len(kv.used)))) / len(kv.used) if kv.used else 0.0,
        prefill_capacity=sched.prefill_capacity,
        num_ranks=len(kv.used),
    )
