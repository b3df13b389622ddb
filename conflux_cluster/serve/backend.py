"""The ingress's transport to the cluster: ask the router, then stream from the chosen instance.

Both hops are Ray Serve handle calls; token deltas come back over one feed per instance
(``feed_client.py``: one message per engine step for all of this replica's requests, not one per token). The router may refuse (every instance's queue is full,
``conflux_cluster.router.state``): ``generate`` then raises a 503 with ``Retry-After`` after that
one call, before anything is sent to an instance; likewise a 503 when no instance is healthy and a 429
when the API key's rate limit is used up. Closing a stream (client gone, handle call
cancelled) cancels the instance-side generator, which aborts the request and frees its KV on
every rank.

An instance that fails a request before any of its output came back (it lost a rank: it refused the
request because the router had not heard yet, or the request was queued or in its first prefill)
costs the client nothing: the request is routed once more, so it lands on a healthy instance (or
gets the router's 503). Once output has come back, the client gets the failure (503 instance_failed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Sequence

from conflux_cluster.engine.contracts.stream import InstanceUnavailable, TokenDelta
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.kv.prefix_hash import block_hashes
from conflux_cluster.engine.contracts.cluster import Draining, Overloaded, RateLimited, Routed, Unavailable

from .errors import draining, overloaded, rate_limited, unavailable
from .feed_client import FeedClient

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


class ServeBackend:
    """Routes through the router deployment; streams from XP-instance deployments."""

    def __init__(self, router: DeploymentHandle, instances: Sequence[DeploymentHandle], prefix_block_tokens: int | None = None) -> None:
        self.router = router  # DeploymentHandle of actors.router_actor.GlobalRouter
        self.instances = list(instances)  # DeploymentHandle per XP instance, router's index order
        self._feeds = [FeedClient(h) for h in self.instances]  # this replica's delta feed per instance
        self.prefix_block_tokens = prefix_block_tokens  # hash prompt prefixes for the router (prefix_aware)

    def close(self) -> None:
        """End this replica's feeds (the replica stops)."""
        for feed in self._feeds:
            feed.close()

    async def warm(self) -> None:
        """Open this replica's feed to every instance and make the first router call now: Serve sets a
        handle's routing up at its first call and a feed opens at its first request, which the first
        request after "ready" would otherwise wait for."""
        for feed in self._feeds:
            feed.open()
        await self.router.live_instances.remote()

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[AsyncIterator[TokenDelta]]:
        """Route ``requests`` (the n choices of one arrival go to one instance) and submit them there; a
        refusal (router or instance) raises here, before any stream starts."""
        instance = await self._admit(requests)
        streams: list[AsyncIterator[TokenDelta]] = []
        submitted: list[tuple[int, str]] = []
        try:
            for r in requests:
                at, deltas = await self._submit(r, instance)
                submitted.append((at, r.request_id))
                streams.append(self._stream(r, at, deltas))
        except BaseException:
            for at, rid in submitted:  # the choices already submitted are aborted (their streams never started)
                self._feeds[at].cancel(rid)
            raise
        return streams

    async def _submit(self, request: GenerateRequest, instance: int) -> tuple[int, AsyncIterator[TokenDelta]]:
        """Submit to ``instance``; one that refuses untouched (it lost a rank, the router had not heard yet)
        is replaced by the router's next choice, once."""
        try:
            deltas = await self._feeds[instance].submit(request)
        except InstanceUnavailable as e:  # Ray's wrapper is an instance too
            if e.in_flight:
                raise
            instance = await self._admit([request], refused_by=instance)
            deltas = await self._feeds[instance].submit(request)
        return instance, deltas

    async def _admit(self, requests: Sequence[GenerateRequest], refused_by: int | None = None) -> int:
        """The instance the router picks for ``requests``, or the router's refusal as an ``APIError``
        (``refused_by``: the instance that refused them untouched; they are not charged to the client's
        rate limit again)."""
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        hashes: tuple[int, ...] = ()
        if self.prefix_block_tokens and requests:  # the n choices of one arrival share the prompt
            hashes = tuple(block_hashes(requests[0].prompt_token_ids, self.prefix_block_tokens))
        client = None if refused_by is not None else requests[0].client
        decision = await self.router.admit.remote(prompt_tokens, len(requests), client, refused_by, hashes)
        if isinstance(decision, Overloaded):
            raise overloaded(decision.retry_after_s)
        if isinstance(decision, Unavailable):
            raise unavailable(decision.retry_after_s)
        if isinstance(decision, Draining):
            raise draining(decision.retry_after_s)
        if isinstance(decision, RateLimited):
            raise rate_limited(decision.retry_after_s, decision.requests_per_minute)
        assert isinstance(decision, Routed), decision
        return decision.instance

    async def _stream(self, request: GenerateRequest, instance: int, deltas: AsyncIterator[TokenDelta]
                      ) -> AsyncIterator[TokenDelta]:
        """The request's deltas from ``instance``; routed once more, elsewhere, if that instance fails it (lost
        a rank) before any output of it came back: the client has seen nothing of it, so it starts over on
        another instance."""
        yielded = False
        try:
            try:
                async for delta in deltas:
                    yielded = True
                    yield delta
                return
            except InstanceUnavailable:  # Ray's wrapper is an instance too
                if yielded:
                    raise
            instance = await self._admit([request], refused_by=instance)
            deltas = await self._feeds[instance].submit(request)
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()  # not finished: the instance aborts it
