"""The in-engine baselines on Ray rank actors (what ``conflux serve --xp-mode`` runs): ``uniform-tp``
(one logical rank, TP over both actors) and ``no-cobatch`` (prefill and decode in separate
iterations) give the same greedy tokens as one in-process rank, and free every KV block."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from conflux_cluster import llm as llm_mod  # noqa: E402
from conflux_cluster.engine.sampling_params import SamplingParams  # noqa: E402
from conflux_cluster.engine.scheduler.config import SchedulerConfig  # noqa: E402

PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again.", "abc" * 17]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
KW = dict(model="tiny-llama", dtype="float32", scheduler=SchedulerConfig(max_num_batched_tokens=16), num_threads=1,
          load_progress=False, block_size=4, num_kv_blocks=256)


def _tokens(llm) -> list[list[int]]:
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", ["uniform-tp", "no-cobatch"])
def test_ray_rank_actors_run_the_baseline_modes(mode: str, shared_ray) -> None:
    from conflux_cluster.actors.ray_llm import RayLLM

    ref = _tokens(llm_mod.LLM(**KW))
    llm = RayLLM(ranks=2, xp_mode=mode, control_plane="actor_calls", **KW)
    ex = llm.engine.executor
    assert len(ex.ranks) == 2  # one actor per device either way
    assert (llm.config.num_ranks, llm.config.tp_size) == ((1, 2) if mode == "uniform-tp" else (2, 1))
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert ex.kv_blocks_held() == [0, 0]
        calls, steps = ex.stats.calls, llm.engine.scheduler._step
    finally:
        llm.shutdown()
    assert got == ref
    # no-cobatch: steps with both phases ran as two iterations; otherwise one iteration per step
    assert calls > steps if mode == "no-cobatch" else calls == steps
