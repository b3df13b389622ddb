"""``LLM(..., ranks=N)`` runs an XP instance through the real EngineCore and Scheduler (waterfill
slices, decode placement, transitions): same greedy tokens as ``ranks=1``, per mode."""

from __future__ import annotations

import pytest

from conflux_cluster import llm as llm_mod
from conflux_cluster.engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again.",
           "Conflux parallelism co-batches prefill and decode.",
           "abc" * 17]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _tokens(**kw) -> list[list[int]]:
    llm = llm_mod.LLM(model="tiny-llama", dtype="float32", max_num_batched_tokens=16, num_threads=1,
                      load_progress=False, block_size=4, num_kv_blocks=256, **kw)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        if hasattr(llm.engine.executor, "kv_free"):
            assert all(llm.engine.executor.kv_free())
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def single() -> list[list[int]]:
    return _tokens()


@pytest.mark.parametrize("mode", ["xp", "uniform-sp"])
def test_llm_two_ranks_same_tokens(mode: str, single) -> None:
    got = _tokens(ranks=2, mode=mode)
    assert got == single
    assert all(len(t) == PARAMS.max_tokens for t in got)
