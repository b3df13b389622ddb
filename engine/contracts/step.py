"""The scheduler -> ranks contract: one typed ``StepPlan`` per iteration (DESIGN §3).

Vocabulary (paper §4, §6): an XP instance has N logical ranks. Each iteration every rank runs
its local prefill tokens and its resident decode tokens through the shared linear layers in one
batch. Prefill attention is Ulysses-SP over all ranks; decode attention stays on ``decode_rank``.

A request's prefill chunk this step is ``[chunk_start, chunk_end)`` of its prompt. Waterfill pours
the chunk into ranks as contiguous, in-order sub-slices (sequence-sharded for the linears)::

    prompt:  |---- computed ----|====== chunk this step ======|---- rest ----|
                                 [r0 slice ][r2 slice ][r3 s.]
                                 start      ...               end

KV blocks are allocated by each rank's own KV manager (deterministically, from this plan), so
no block table travels; the scheduler keeps the same accounting (``KVUsage``) to never plan
what does not fit. A request whose final chunk runs this step names its ``decode_rank`` in
``transitions``; its head-sharded KV is gathered there and it decodes locally from next step.

Prefix cache (docs/prefix-caching.md): cached full blocks live in one rank's decode layout. A
request that starts with a hit decodes on that rank; ``prefix_hits`` tells the ranks to begin its
decode table with those blocks and (N > 1) to scatter them into the head-sharded prefill layout
of every rank, so its prefill starts at ``PrefixHit.num_tokens`` like a request whose earlier
chunks already ran. After its transition, ``cache_inserts`` adds its full prompt blocks to the
cache; ``evicted`` frees cached blocks nobody references.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..prompt_logprobs import PromptLogprob
from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillSlice:
    """Prompt tokens ``[start, end)`` of ``request_id`` processed on ``rank`` this step."""

    request_id: str
    rank: int  # rank whose shared-linear batch carries these tokens
    start: int  # first prompt position (inclusive); positions are start..end-1
    end: int  # last prompt position (exclusive)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class DecodeTransition:
    """``request_id`` finishes prefill this step; it decodes on ``decode_rank`` from the next step."""

    request_id: str
    decode_rank: int
    start: int = 0  # positions [0, start) are already in the decode rank's layout (a prefix-cache hit)


@dataclass(frozen=True)
class PrefixHit:
    """``request_id`` starts its prefill this step with a cached prefix on ``rank`` (its decode rank)."""

    request_id: str
    rank: int
    hashes: tuple[int, ...]  # chained hashes of blocks 0..len-1 (decode layout, ``block_size`` tokens each)
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size


@dataclass(frozen=True)
class CacheInsert:
    """After this step, ``rank`` caches the blocks ``first_block, first_block + 1, ...`` of
    ``request_id``'s decode table under ``hashes``, stopping at the first hash it already caches."""

    request_id: str
    rank: int
    first_block: int
    hashes: tuple[int, ...]


@dataclass
class StepPlan:
    """Everything the ranks need for one iteration. Sent to every rank (small: ids and ranges)."""

    step: int  # iteration counter, strictly increasing
    prefill: list[PrefillSlice] = field(default_factory=list)  # in-order slices, any ranks
    decode: list[list[str]] = field(default_factory=list)  # decode[r]: request ids decoding on r
    transitions: list[DecodeTransition] = field(default_factory=list)  # last chunk runs now
    finished: list[str] = field(default_factory=list)  # free these requests' KV (done/aborted/preempted)
    # subset of ``finished`` that is not over: preempted (KV exhausted), to be re-sent by the engine
    # with its outputs so far folded into the prompt (recompute)
    preempted: list[str] = field(default_factory=list)
    prefix_hits: list[PrefixHit] = field(default_factory=list)  # first chunk runs now, after a hit
    cache_inserts: list[CacheInsert] = field(default_factory=list)  # applied after the step ran
    # finished requests' full blocks beyond their cached prompt (outputs too: a chat's next turn repeats
    # them) that join the cache before ``finished`` frees their tables
    retained: list[CacheInsert] = field(default_factory=list)
    evicted: list[list[int]] = field(default_factory=list)  # evicted[r]: hashes rank r frees first
    prefix_queries: int = 0  # prompt tokens looked up in the cache by prefills starting now (metrics only)

    def num_ranks(self) -> int:
        return len(self.decode)

    def prefill_tokens_per_rank(self) -> list[int]:
        """n_p^r: prefill tokens on each rank."""
        counts = [0] * self.num_ranks()
        for s in self.prefill:
            counts[s.rank] += s.num_tokens
        return counts

    def decode_tokens_per_rank(self) -> list[int]:
        """n_d^r: decode tokens on each rank (one per resident decode)."""
        return [len(ids) for ids in self.decode]

    def is_empty(self) -> bool:
        return not self.prefill and not any(self.decode)


@dataclass(frozen=True)
class StepResult:
    """Ranks -> scheduler: the token sampled for each request that produced one this step.

    A request produces a token when it decoded this step or when its final prefill chunk ran.
    """

    step: int
    sampled: dict[str, int]  # request id -> sampled token id
    logprobs: dict[str, float] = field(default_factory=dict)  # request id -> logprob of sampled
    # request id -> [(token id, logprob)] of the most likely tokens, for requests that asked (logprobs=k)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # request id -> prompt position -> its score, for requests that asked (prompt_logprobs) and prefilled here
    prompt_logprobs: dict[str, dict[int, PromptLogprob]] = field(default_factory=dict)
    # seconds the slowest rank spent executing this step (summed over its iterations), when the
    # executor measures it (RayExecutor); the step log sets it beside the step's wall time
    compute_s: float | None = None
    # seconds the slowest rank's host took to launch this step (summed over its iterations), where ranks
    # launch ahead (RayExecutor's compiled graph): near the step's own time, the launch waited on the device
    launch_s: float | None = None
    # CUDA: seconds of the slowest rank's device timeline the step took (summed over its iterations), from
    # when it could start (the step before it done, its launch begun) to its last kernel's end: what the
    # step costs where launches run ahead, without the next step's launch that its wall time holds
    device_s: float | None = None


def step_device_s(iterations: list[list[StepResult]]) -> float | None:
    """A step's ``device_s`` from its ranks' results, per iteration: the slowest rank's, summed; None
    when no rank measured it (not CUDA). A rank without work in an iteration launched nothing to time."""
    times = [[r.device_s for r in it if r.device_s is not None] for it in iterations]
    if not any(times):
        return None
    return sum(max(it, default=0.0) for it in times)


@dataclass(frozen=True)
class NewRequest:
    """What a rank needs to know about a request it has not seen (sent once, with its first step)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or the one the engine drew for an unseeded request
    # outputs already produced and folded into ``prompt_token_ids`` (a preempted request that
    # recomputes): its next sample has this output index, so seeded sampling continues unchanged
    num_output: int = 0
    # min_tokens: the ids it cannot sample before min_tokens outputs (EOS unless ignore_eos, stop_token_ids)
    min_tokens_blocked: tuple[int, ...] = ()


@dataclass
class StepInput:
    """``StepPlan`` plus what ranks cannot know themselves (the scheduler process -> every rank, per step)."""

    plan: StepPlan
    new_requests: list[NewRequest] = field(default_factory=list)  # added since the previous step
    first_tokens: dict[str, int] = field(default_factory=dict)  # request id -> token sampled after its prompt


@dataclass(frozen=True)
class RankReply:
    """What a rank sends back per step: its result and how long it computed (for the control-plane share)."""

    result: StepResult  # only rank 0's is used when all ranks agree
    compute_s: float  # seconds inside worker.execute on this rank
    launch_s: float | None = None  # launching ahead: seconds ``worker.launch`` of this step took on the host


@dataclass(frozen=True)
class Rendezvous:
    """Where an instance's ranks find rank 0's process-group store (sent to each rank at start-up,
    N > 1; ``engine/xp/launch.py`` hosts the store and joins the group)."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" (CPU) or "nccl" (GPU)
    timeout_s: float = 300.0


@dataclass(frozen=True)
class RankSetup:
    """What a rank reports once its worker is built."""

    node_id: str  # Ray node the actor runs on
    blocks_per_rank: int  # KV blocks its pool holds (the same on every rank of the instance)
    setup_s: float = 0.0  # seconds the worker took to build: weights, KV pool, CUDA graphs
    graphs_s: float = 0.0  # of which the CUDA graph capture (0 without graphs)


@dataclass(frozen=True)
class RankMemory:
    """One rank process's memory now (the soak's flatness check reads it)."""

    rss_mb: float  # resident set of the process
    cuda_allocated_mb: float | None  # torch.cuda.memory_allocated (tensors alive); None on CPU
    cuda_reserved_mb: float | None  # torch.cuda.memory_reserved (held by the caching allocator); None on CPU
