"""Small shared parts of the baselines' own schedulers: request progress, queue order, decode pools."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..workloads import SimRequest


@dataclass
class Job:
    """A request inside a baseline's scheduler."""

    req: SimRequest
    computed: int = 0  # prompt tokens prefilled
    generated: int = 0  # output tokens emitted

    @property
    def remaining(self) -> int:
        return self.req.prompt_len - self.computed

    @property
    def context(self) -> int:
        return self.computed + self.generated

    @property
    def kv_need(self) -> int:
        return self.req.prompt_len + self.req.output_len


def ordered(jobs: list[Job], policy: str) -> list[Job]:
    """fcfs: arrival order; srpt ("++"): fewest remaining prefill tokens first, then arrival."""
    if policy == "srpt":
        return sorted(jobs, key=lambda j: (j.remaining, j.req.arrival))
    if policy == "fcfs":
        return sorted(jobs, key=lambda j: j.req.arrival)
    raise ValueError(f"unknown baseline policy {policy!r} (fcfs or srpt)")


def pairs(chunk: int, computed: int) -> float:
    """Causal token-pairs of a chunk of ``chunk`` tokens after ``computed`` (Eq. 9)."""
    return chunk * (computed + (chunk + 1) / 2)


@dataclass
class DecodePool:
    """Decodes resident on one GPU group, limited by its KV capacity (tokens: prompt + max output
    reserved at join, as the engine does) and by ``max_seqs``."""

    kv_tokens: int
    max_seqs: int
    jobs: dict[str, Job] = field(default_factory=dict)
    reserved: int = 0

    def fits(self, job: Job) -> bool:
        return len(self.jobs) < self.max_seqs and self.reserved + job.kv_need <= self.kv_tokens

    def join(self, job: Job) -> None:
        self.jobs[job.req.request_id] = job
        self.reserved += job.kv_need

    def leave(self, request_id: str) -> None:
        job = self.jobs.pop(request_id)
        self.reserved -= job.kv_need

    @property
    def context(self) -> int:
        return sum(j.context for j in self.jobs.values())


def take_prefill_batch(queue: list[Job], policy: str, max_tokens: int) -> tuple[list[Job], int]:
    """Remove from ``queue`` the whole-prompt prefill batch of at most ``max_tokens`` remaining
    tokens (always at least one job), in ``policy`` order; returns the batch and its token total."""
    batch, total = [], 0
    for job in ordered(queue, policy):
        if batch and total + job.remaining > max_tokens:
            break
        batch.append(job)
        total += job.remaining
    for job in batch:
        queue.remove(job)
    return batch, total
