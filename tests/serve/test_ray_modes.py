"""The in-engine baselines on Ray rank actors (what ``conflux serve --xp-mode`` runs): ``uniform-tp``
(one logical rank, TP over both actors) and ``no-cobatch`` (prefill and decode in separate
iterations) give the same greedy tokens as one in-process rank, and free every KV block."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("ranks,mode", [(1, "xp"), (2, "no-cobatch")])
def test_compiled_graph_ranks_launch_ahead_with_the_same_tokens(ranks: int, mode: str, shared_ray, tmp_path) -> None:
    """Over the compiled graph each rank launches step k+1 before it reads step k's tokens and answers
    each call with the reply to the one before (``RankActorImpl.execute_ahead``): the same seeded tokens
    as one in-process rank, every call's reply read, every KV block freed; the step log carries each
    step's launch host time."""
    from conflux_cluster.actors.ray_llm import RayLLM

    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)
    ref = llm_mod.LLM(**KW)
    try:
        want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params)]
    finally:
        ref.shutdown()
    # on CPU ranks launch_ahead is off by default (a CPU computes inside launch): forced on here
    log = tmp_path / "steps.jsonl"
    llm = RayLLM(ranks=ranks, xp_mode=mode, control_plane="compiled_graph", launch_ahead=True,
                 step_log=str(log), **KW)
    ex = llm.engine.executor
    try:
        assert ex.stats.kind == "compiled_graph" and llm.engine.pipelined and ex._ahead
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert ex.kv_blocks_held() == [0] * ranks
        assert not ex._unread and not ex._replies and ex._read == ex._calls
    finally:
        llm.shutdown()
    assert got == want
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert steps and all(0 < s["launch_s"] < 60 for s in steps), steps[:3]
