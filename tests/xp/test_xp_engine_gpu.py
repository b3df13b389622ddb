"""The multi-process XP engine on GPUs (NCCL, side stream, Triton decode, piecewise CUDA graphs):
greedy tokens equal the single-rank engine on one GPU. Needs 2 GPUs (``gpu`` mark)."""

from __future__ import annotations

import pytest
import torch

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import ModelSource
from conflux_cluster.engine.models.config import ModelConfig
from conflux_cluster.engine.runtime.multiproc import MultiprocExecutor

from .driver import run_scenario, scenario

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

# head_dim 16 and 16-token blocks: the Triton paged decode kernel takes the decode path
TINY = ModelConfig(architecture="llama", vocab_size=300, hidden_size=128, intermediate_size=192,
                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False)
SOURCE = ModelSource("tiny-8-2", "preset", None, TINY)


def _config(**kw) -> EngineConfig:
    return EngineConfig(model="tiny-8-2", device="cuda", dtype="float32", block_size=16, num_kv_blocks=128,
                        seed=3, load_progress=False, **kw)


@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch):
    """fp32 everywhere (no TF32 in cuBLAS or in Triton's dots), so tokens can be compared exactly."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    torch.backends.cuda.matmul.allow_tf32 = False  # (the default; spawned workers start with it)


@pytest.mark.parametrize("graphs", [False, True])
def test_two_gpu_xp_tokens_match_single_rank(graphs: bool) -> None:
    ref = LocalExecutor(_config(cuda_graphs=False), SOURCE)  # eager single-rank reference
    want = {s: run_scenario(ref, 1, s, scenario(s, TINY.vocab_size)) for s in (1, 2)}
    ref.check_invariants()
    del ref
    with MultiprocExecutor(_config(num_ranks=2, cuda_graphs=graphs, cuda_graph_max_tokens=16), SOURCE) as ex:
        for mode in ("xp", "xp-no-overlap", "uniform-sp"):
            ex.set_mode(mode)
            for s in (1, 2):
                got = run_scenario(ex, 2, 100 + s, scenario(s, TINY.vocab_size))
                assert got == want[s], f"graphs={graphs} mode {mode} seed {s}: tokens differ from one rank"
            assert all(ex.kv_free()), f"mode {mode}: KV blocks still held"
