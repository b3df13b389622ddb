"""What the scheduler knows about a request: lengths, progress, deadlines. No tokens, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Phase(str, Enum):
    WAITING = "waiting"  # prefill not finished (may be partly computed)
    DECODING = "decoding"  # resident on decode_rank
    FINISHED = "finished"


@dataclass(eq=False)
class SchedRequest:
    """Scheduler-side view of one request (compared by identity)."""

    request_id: str
    prompt_len: int  # tokens to prefill: the prompt (+ outputs so far, after a preemption)
    max_new_tokens: int  # output cap still to go (prompt_len + this must fit one rank's KV pool)
    arrival: float  # seconds (engine clock or simulated clock)
    ttft_deadline: float  # arrival + TTFT SLO
    computed: int = 0  # prompt tokens already prefilled (KV exists for [0, computed))
    generated: int = 0  # output tokens produced so far
    decode_rank: int | None = None  # set when the final prefill chunk is scheduled
    phase: Phase = Phase.WAITING
    seq: int = 0  # arrival sequence number, set by Scheduler.add (tie-breaks)
    priority: int = 0  # lower is scheduled first, in every policy (vLLM's priority); 0 for most
    num_preemptions: int = 0  # times its KV was freed to make room (it then recomputes)
    # prefix cache (engine/kv/prefix_hash.py): chained hashes of the prompt's full KV blocks, in order
    block_hashes: list[int] = field(default_factory=list)
    cached: int = 0  # prompt tokens served by the prefix cache (a guess until its prefill starts)
    hit_rank: int | None = None  # rank holding its cached prefix, once its prefill started with a hit
    prefix_memo: dict[int, tuple[int, int]] = field(default_factory=dict)  # PrefixIndex.match's, per rank
    # policy slo (deferred.py): when a first-come-first-served order would have started its first token, by a
    # virtual FCFS clock at its arrival (every earlier request's prefill work at the step budget of the time)
    fcfs_due: float = float("inf")
    step_share: float = 1.0  # policy slo (deferred.py): the most of a step's token budget its next chunk may take

    @property
    def remaining_prefill(self) -> int:
        """m_i: prompt tokens still to prefill (cached tokens are free work)."""
        return self.prompt_len - max(self.computed, self.cached)

    @property
    def context_len(self) -> int:
        """c_i: tokens whose KV exists (prompt computed + generated outputs)."""
        return self.computed + self.generated

    @property
    def max_context(self) -> int:
        return self.prompt_len + self.max_new_tokens
