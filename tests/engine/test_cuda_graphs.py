"""Piecewise CUDA graphs (engine/runtime/cuda_graphs.py).

CPU: the segment decomposition (run eagerly) is the model's forward bit for bit, buckets, and the
config flag leaves CPU engines unchanged. GPU (``gpu`` mark): greedy tokens of an engine that
replays graphs equal the eager engine's, with batches both inside and above the largest bucket.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.contracts.request import GenerateRequest
from conflux_cluster.engine.core import EngineCore
from conflux_cluster.engine.runtime.cuda_graphs import GraphedCausalLM, PiecewiseCudaGraphs, default_buckets
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.loader import load_model, resolve_model
from conflux_cluster.engine.sampling_params import SamplingParams
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.tokenizer import ByteTokenizer

from .helpers import drain

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _causal_attn(layer, q, k, v, meta):
    """Real causal GQA attention over the rows as one sequence (q [T, Hq, D], k/v [T, Hkv, D])."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1) * (1.0 + layer)  # layer-dependent: a wrong layer index would show


def test_default_buckets():
    b = default_buckets(1024)
    assert b == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024)
    assert default_buckets(512) == b[:11]
    big = default_buckets(4096)
    assert big[:15] == b and big[-1] == 4096 and list(big) == sorted(set(big))
    assert all(n / p <= 1.5 for p, n in zip(big[8:], big[9:]))  # bounded padding above 256
    assert default_buckets(100)[-1] == 100
    with pytest.raises(ValueError):
        default_buckets(0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_segments_equal_forward_on_cpu(preset):
    model = load_model(resolve_model(preset), torch.float32, "cpu", progress=False, seed=3)
    g = GraphedCausalLM(model)
    assert g.graphs.enabled is False and g.graphs.num_layers == model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(5, 16)
    rows = torch.tensor([3, 10])
    with torch.inference_mode():
        ref = model(ids, pos, _causal_attn, None, sample_rows=rows)
        got = g(ids, pos, _causal_attn, None, sample_rows=rows)
    assert ref.abs().max() > 0.1
    assert torch.equal(got, ref)
    assert g.graphs.eager_runs == 1 and g.graphs.replays == 0


def test_runner_rejects_bad_segments():
    with pytest.raises(ValueError):
        PiecewiseCudaGraphs([lambda x: (x,)], lambda b: (torch.zeros(b),))
    with pytest.raises(ValueError):
        PiecewiseCudaGraphs([lambda x: (x,)] * 2, lambda b: (torch.zeros(b),), buckets=[0, 4])


def _engine(device: str, graphs: bool, max_tokens: int = 512, dtype: str = "float32") -> EngineCore:
    cfg = EngineConfig(model="tiny-llama", device=device, dtype=dtype, block_size=16, num_kv_blocks=128,
                       load_progress=False, cuda_graphs=graphs, cuda_graph_max_tokens=max_tokens, seed=1,
                       scheduler=SchedulerConfig(max_num_batched_tokens=48))
    src = resolve_model("tiny-llama")
    return EngineCore(cfg, LocalExecutor(cfg, src), source=src, tokenizer=ByteTokenizer())


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    return {f"r{i}": torch.randint(0, 256, (n,), generator=gen).tolist() for i, n in enumerate([70, 5, 33, 1, 17])}


def _tokens(core: EngineCore) -> dict[str, list[int]]:
    for rid, ids in _prompts().items():
        core.add_request(GenerateRequest(rid, ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    return drain(core)


def test_flag_is_ignored_on_cpu():
    core = _engine("cpu", graphs=True)
    assert core.executor.worker.graphed is None
    assert _tokens(core) == _tokens(_engine("cpu", graphs=False))


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("max_tokens", [512, 8])
def test_graphs_same_greedy_tokens_on_cuda(max_tokens):
    """max_tokens=8: prefill batches (up to 48 rows) run eagerly, decode batches replay graphs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    eager = _tokens(_engine("cuda", graphs=False))
    core = _engine("cuda", graphs=True, max_tokens=max_tokens)
    got = _tokens(core)
    runner = core.executor.worker.graphed.graphs
    assert runner.enabled and runner.replays > 0
    if max_tokens == 8:
        assert runner.eager_runs > 0
    assert got == eager
    core.executor.check_invariants()


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_same_greedy_tokens_on_cuda(dtype):
    """A one-GPU instance's worker (XP backend): decode-only steps replay whole-forward graphs
    (attention captured too); tokens equal the same worker without graphs."""
    from conflux_cluster.engine.runtime.build import local_worker

    torch.backends.cuda.matmul.allow_tf32 = False

    def tokens(graphs: bool) -> tuple[dict[str, list[int]], EngineCore]:
        cfg = EngineConfig(model="tiny-llama", device="cuda", dtype=dtype, block_size=16, num_kv_blocks=128,
                           load_progress=False, cuda_graphs=graphs, seed=1,
                           scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4))
        src = resolve_model("tiny-llama")
        core = EngineCore(cfg, LocalExecutor(cfg, src, worker=local_worker(cfg, src)), source=src,
                          tokenizer=ByteTokenizer())
        return _tokens(core), core

    eager, _ = tokens(False)
    got, core = tokens(True)
    worker = core.executor.worker
    assert worker.decode_graphs is not None and worker.decode_graphs.replays > 0
    assert got == eager
    worker.check_invariants()
    kv = worker.attention.kv  # blocks of cached prefixes stay (prefix caching is on by default)
    assert kv.num_free_blocks + len(kv.cache) == kv.num_blocks and not kv.prefill and not kv.decode
