"""Greedy tokens of a tiny random model (9 q / 3 kv heads like SmolLM2): the XP instance (real
gloo worker processes running RankWorker) matches the single-rank engine (LocalExecutor) for
N in {2, 3, 4}, for 2 logical ranks x TP2 and for every execution mode, under seeded random plans
(uneven/empty rank slices, chunked prompts arriving while others decode); pools free afterwards."""

from __future__ import annotations

import pytest

from conflux_cluster.engine.config import EngineConfig, xp_topology
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import ModelSource
from conflux_cluster.engine.models.config import ModelConfig
from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor

from .driver import run_scenario, scenario

TINY = ModelConfig(architecture="llama", vocab_size=300, hidden_size=72, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
SOURCE = ModelSource("tiny-9-3", "preset", None, TINY)
SEEDS = (1, 2)


def _config(**kw) -> EngineConfig:
    return EngineConfig(model="tiny-9-3", dtype="float32", block_size=4, num_kv_blocks=128, seed=3,
                        num_threads=1, load_progress=False, **kw)


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[str, list[int]]]:
    ex = LocalExecutor(_config(), SOURCE)
    out = {s: run_scenario(ex, 1, s, scenario(s, TINY.vocab_size)) for s in SEEDS}
    ex.check_invariants()
    return out


def _check(config: EngineConfig, plan_ranks: int, reference, modes=(None,)) -> None:
    with MultiprocExecutor(config, SOURCE) as ex:
        for mode in modes:
            if mode is not None:
                ex.set_mode(mode)
            for s in SEEDS:
                got = run_scenario(ex, plan_ranks, 100 + s, scenario(s, TINY.vocab_size))
                assert got == reference[s], f"mode {mode} seed {s}: tokens differ from the single-rank engine"
            assert all(ex.kv_free()), f"mode {mode}: KV blocks still held: {ex.kv_free()}"


@pytest.mark.parametrize("num_ranks", [3, 4])
def test_xp_tokens_match_single_rank(num_ranks: int, reference) -> None:
    _check(_config(num_ranks=num_ranks), num_ranks, reference)


def test_two_ranks_every_mode_same_tokens(reference) -> None:
    _check(_config(num_ranks=2), 2, reference, modes=("xp", "xp-no-overlap", "uniform-sp", "no-cobatch"))


def test_two_logical_ranks_with_tp2(reference) -> None:
    _check(_config(num_ranks=2, tp_size=2), 2, reference)


def test_uniform_tp_same_tokens(reference) -> None:
    config = _config(num_ranks=2, xp_mode="uniform-tp")
    topo = xp_topology(config)
    assert (topo.num_ranks, topo.tp_size) == (1, 2)
    _check(config, 1, reference)


def test_worker_error_propagates_and_all_workers_stop() -> None:
    from conflux_cluster.engine.contracts.step import PrefillSlice, StepInput, StepPlan
    from conflux_cluster.engine.runtime.multiproc import WorkerError

    ex = MultiprocExecutor(_config(num_ranks=2), SOURCE)
    procs = list(ex._procs)
    bad = StepPlan(0, prefill=[PrefillSlice("never-added", 1, 0, 4)], decode=[[], []])
    with pytest.raises(WorkerError, match="never-added"):
        ex.execute(StepInput(bad))
    for p in procs:
        p.join(timeout=30)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.execute(StepInput(bad))
