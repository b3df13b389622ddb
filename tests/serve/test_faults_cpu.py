"""benchmarks/faults.py end to end on CPU, small: real servers (tiny-llama, 2 CPU ranks), real HTTP.

* disconnect storm and a short soak on one server (a 64-block pool per rank): streams dropped mid-prefill
  and mid-decode leave no KV block behind; the soak's mixed traffic has 0 errors, its memory stays flat
  and KV ends at zero;
* KV pressure on two servers, float32: the tight pool preempts (its counter moves), the ample one does
  not, and greedy outputs are token-identical, each stream exactly max_tokens long, KV back to zero.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.faults import Sizes, run_group, run_pressure
from conflux_cluster.engine.config import Device


@pytest.fixture(autouse=True)
def _own_ray():
    """Each test's servers start a Ray of their own, and none outlives the test: a pytest worker left
    connected to a Ray whose GCS is gone is ended by Ray ~60 s later ("[gwN] node down"), in whatever
    test it runs by then (benchmarks/fault_helpers.py, Server.start)."""
    import ray

    if ray.is_initialized():  # another module's Ray must not leak into this one
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.slow
def test_disconnect_storm_and_short_soak_on_one_small_server():
    sizes = Sizes(storm_streams=12, long_tokens=400, duration_s=10.0, soak_rate=2.0, soak_warmup_s=3.0)
    disconnect, soak = asyncio.run(run_group(["disconnect", "soak"], "tiny-llama", Device.CPU, sizes,
                                             {"num_kv_blocks": 64}))
    assert disconnect.ok, disconnect
    assert disconnect.figures["dropped"]["prefill"] >= 4 and disconnect.figures["dropped"]["decode"] >= 4
    assert soak.ok, soak
    assert soak.figures["requests"] >= 10 and soak.figures["growth_after_warmup"]["rss_mb"] is not None


@pytest.mark.slow
def test_kv_pressure_preempts_and_outputs_equal_the_ample_pool():
    sizes = Sizes(pressure_long=4, pressure_long_tokens=200, pressure_short=6, pressure_out=80)
    res = run_pressure("tiny-llama", Device.CPU, sizes)
    assert res.ok, res
    f = res.figures
    assert f["preemptions_tight"] > 0 and f["preemptions_ample"] == 0
    assert f["demand_tokens"] > f["tight_pool_tokens"] >= f["prompt_tokens"]
    assert f["mismatched"] == [] and f["wrong_length"] == [] and f["statuses"] == [200]
