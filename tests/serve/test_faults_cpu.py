"""The smallest disconnect storm and KV-pressure run of benchmarks/faults.py, end to end on CPU: a real
server (tiny-llama, 2 CPU ranks, a 64-block pool per rank), real HTTP. Streams dropped mid-prefill and
mid-decode leave no KV block behind; prompts beyond the pool are served, greedy outputs equal to each
prompt served alone."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.faults import Sizes, run_group


@pytest.mark.slow
def test_disconnect_storm_and_kv_pressure_on_one_small_server():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    sizes = Sizes(storm_streams=12, long_tokens=400, pressure_short=4)
    disconnect, pressure = asyncio.run(run_group(["disconnect", "pressure"], "tiny-llama", "cpu", sizes,
                                                 {"num_kv_blocks": 64}))
    assert disconnect.ok, disconnect
    assert disconnect.figures["dropped"]["prefill"] >= 4 and disconnect.figures["dropped"]["decode"] >= 4
    assert pressure.ok, pressure
    assert pressure.figures["prompt_tokens_at_once"] > pressure.figures["pool_tokens"]
