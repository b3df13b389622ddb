"""The ingress's transport to the cluster: ask the router, then stream from the chosen instance.

Both hops are Ray Serve handle calls. The router may refuse (every instance's queue is full,
``conflux_cluster.router.state``): ``generate`` then raises a 503 with ``Retry-After`` after that
one call, before anything is sent to an instance. Closing a stream (client gone, handle call
cancelled) cancels the instance-side generator, which aborts the request and frees its KV on
every rank.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from conflux_cluster.actors.streams import GenerateRequest, Sampling, TokenDelta
from conflux_cluster.engine.prefix_hash import block_hashes
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.router.state import Overloaded

from .errors import bad_request, overloaded


def engine_params(s: Sampling) -> SamplingParams:
    """Validated ``Sampling`` -> the engine's ``SamplingParams`` (a 400 if the engine rejects it)."""
    try:
        return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=s.seed, stop=list(s.stop), ignore_eos=s.ignore_eos,
                              logprobs=0 if s.logprobs else None)
    except ValueError as e:
        raise bad_request(f"invalid sampling parameters: {e}") from None


class ServeBackend:
    """Routes through the router deployment; streams from XP-instance deployments."""

    def __init__(self, router: Any, instances: Sequence[Any], prefix_block_tokens: int | None = None) -> None:
        self.router = router  # DeploymentHandle of actors.router_actor.GlobalRouter
        self.instances = list(instances)  # DeploymentHandle per XP instance, router's index order
        self.prefix_block_tokens = prefix_block_tokens  # hash prompt prefixes for the router (prefix_aware)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[AsyncIterator[TokenDelta]]:
        params = [engine_params(r.sampling) for r in requests]
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        hashes: tuple[int, ...] = ()
        if self.prefix_block_tokens and requests:  # the n choices of one arrival share the prompt
            hashes = tuple(block_hashes(requests[0].prompt_token_ids, self.prefix_block_tokens))
        decision = await self.router.admit.remote(prompt_tokens, len(requests), hashes)
        if isinstance(decision, Overloaded):
            raise overloaded(decision.retry_after_s)
        handle = self.instances[decision.instance].options(stream=True)
        return [_stream(handle.generate.remote(r, p)) for r, p in zip(requests, params)]


async def _stream(gen: Any) -> AsyncIterator[TokenDelta]:
    """Iterate a Serve response generator; cancel it if the consumer stops early."""
    finished = False
    try:
        async for delta in gen:
            yield delta
            finished = finished or delta.finished
    finally:
        if not finished:
            gen.cancel()
