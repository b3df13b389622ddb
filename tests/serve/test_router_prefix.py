"""Prefix-aware routing: a repeated prefix goes back to the instance it was routed to, unless that
instance's backlog costs more than the prefill the prefix saves; weights and memory matter.
(Most checks use prefix_weight 1: backlog and saving in the same seconds.)"""

from __future__ import annotations

from conflux_cluster.engine.kv.prefix_hash import block_hashes
from conflux_cluster.router import PrefixRouting, RouteRequest, make_policy
from conflux_cluster.engine.contracts.cluster import InstanceLoad
from conflux_cluster.router.state import RouterState
from conflux_cluster.engine.contracts.cluster import LoadReport

CAP = 10_000.0  # prefill tokens per second of every instance
UNIT = PrefixRouting(prefix_weight=1.0)


def _req(tokens: list[int], block: int = 64) -> RouteRequest:
    return RouteRequest(len(tokens), tuple(block_hashes(tokens, block)))


def _loads(queued: list[int]) -> list[InstanceLoad]:
    return [InstanceLoad(queued_prefill_tokens=q, prefill_capacity=CAP) for q in queued]


def test_repeated_prefix_returns_to_its_instance():
    p = make_policy("prefix_aware", prefix=UNIT)
    system = list(range(2000))
    first = p.choose(_loads([0, 0, 0, 0]), _req(system + [1, 2, 3]))
    # later requests with the same prefix return there although others are a little less loaded
    queued = [500, 500, 500, 500]
    queued[first] = 1500  # 0.1 s more backlog than the others; the prefix saves 0.2 s of prefill
    for tail in range(5):
        assert p.choose(_loads(queued), _req(system + [tail] * 100)) == first
    # a prompt sharing nothing goes to the least loaded
    assert p.choose(_loads(queued), _req(list(range(5000, 7000)))) != first


def test_overloaded_holder_loses_the_request():
    p = make_policy("prefix_aware", prefix=UNIT)
    system = list(range(2000))
    first = p.choose(_loads([0, 0]), _req(system))
    queued = [0, 0]
    queued[first] = 4000  # 0.4 s of backlog > 0.2 s saved
    assert p.choose(_loads(queued), _req(system + [9])) == 1 - first
    # the default weight (10) values the saving more: 0.4 s of backlog < 10 x 0.2 s
    default = make_policy("prefix_aware")
    first = default.choose(_loads([0, 0]), _req(system))
    queued = [0, 0]
    queued[first] = 4000
    assert default.choose(_loads(queued), _req(system + [9])) == first
    queued[first] = 30000  # 3 s of backlog > 2 s
    assert default.choose(_loads(queued), _req(system + [9])) == 1 - first


def test_weights_and_memory():
    system = list(range(2000))
    no_prefix = make_policy("prefix_aware", prefix=PrefixRouting(prefix_weight=0.0))
    first = no_prefix.choose(_loads([0, 0]), _req(system))
    queued = [0, 0]
    queued[first] = 100
    assert no_prefix.choose(_loads(queued), _req(system)) == 1 - first  # pure lowest_load
    tiny = make_policy("prefix_aware", prefix=PrefixRouting(capacity_tokens=640))  # remembers 10 blocks
    first = tiny.choose(_loads([0, 0]), _req(system))
    assert tiny.history.match(first, block_hashes(system, 64)) == 0  # the LRU kept the tail only
    assert len(tiny.history._lru[first]) == 10


def test_router_state_passes_prefix_hashes():
    st = RouterState(3, "prefix_aware", capacity=CAP, prefix=UNIT)
    system = list(range(2000))
    h = tuple(block_hashes(system, 64))
    first = st.route(len(system) + 10, 1, h)
    # a burst before any report spreads: the holder's in-flight prompt outweighs the saving
    assert st.route(len(system) + 10, 1, h) != first
    # once the holder reports (its queue: the cached request's suffix), the prefix pulls requests back
    for i in range(3):
        st.report(LoadReport(first, InstanceLoad(queued_prefill_tokens=10, prefill_capacity=CAP),
                             received_prompt_tokens=(i + 1) * 2010, received_requests=i + 1))
        assert st.route(len(system) + 10, 1, h) == first
    assert st.route(10, 1, ()) != first  # no prefix: lowest load
