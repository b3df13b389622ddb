"""KV pool sizing (engine/kv/sizing.py) and the context cap it implies: numbers in, blocks out, on CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from conflux_cluster.engine.kv import sizing as kv_sizing
from conflux_cluster.engine.config import EngineConfig
from conflux_cluster.engine.runtime.executor import LocalExecutor
from conflux_cluster.engine.kv.cache import blocks_for_budget, bytes_per_block
from conflux_cluster.engine.kv.sizing import GiB, DeviceMemory, KVSizing, activation_reserve_bytes
from conflux_cluster.engine.loader import resolve_model
from conflux_cluster.engine.models.config import PRESETS, ModelConfig
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.engine.scheduler.requests import SchedRequest
from conflux_cluster.engine.scheduler.scheduler import Scheduler

LLAMA8B = PRESETS["llama-3.1-8b"]
ROUND = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=100, intermediate_size=300,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=25)


def test_activation_reserve_formula() -> None:
    # per token: 2 * (4*100 + 3*(100 + 2*50) + 3*300) = 2 * 1900; T = max(64, 32) = 64
    # graphs: 2 * 2 layers * (2*100 + 2*50 + 100 + 2*25) * (16 + 32); sampling: 12 * 8 * 1000
    got = activation_reserve_bytes(ROUND, 2, step_tokens=64, sampled_rows=8, graph_buckets=(16, 32))
    assert got == 2 * 1900 * 64 + 2 * 2 * 450 * 48 + 12 * 8 * 1000 + kv_sizing.MISC_RESERVE_BYTES
    # the largest graph bucket counts when it exceeds the step budget
    no_graphs = activation_reserve_bytes(ROUND, 2, 64, 8)
    assert activation_reserve_bytes(ROUND, 2, 16, 8, (128,)) > no_graphs
    # "a few GiB" for Llama-3.1-8B at the defaults, more under the estimator's 16384-token ceiling
    assert 3 * GiB < activation_reserve_bytes(LLAMA8B, 2, 256, 256, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)) < 4 * GiB
    assert 5 * GiB < activation_reserve_bytes(LLAMA8B, 2, 16384, 256, (512,)) < 7 * GiB


def test_budget_to_blocks() -> None:
    mem = DeviceMemory(total=100 * GiB, used=20 * GiB)  # weights + context + other processes
    s = KVSizing(mem, utilization=0.9, reserve=5 * GiB, bytes_per_block=2**20)
    assert s.budget == 65 * GiB and s.blocks == 65 * 1024
    assert "65.00 GiB" in s.describe() and "66560 blocks" in s.describe()
    tight = KVSizing(mem, utilization=0.2, reserve=5 * GiB, bytes_per_block=2**20)
    assert tight.budget < 0 and tight.blocks == 0  # more in use than allowed: no block, not a negative count


def _cuda_config(**kw) -> EngineConfig:
    return EngineConfig(model="llama-3.1-8b", device="cuda", load_progress=False, **kw)


def test_rank_kv_blocks_measures_then_agrees(monkeypatch) -> None:
    total, used = 141 * GiB, 17 * GiB  # an H200 after loading 8B bf16 weights
    monkeypatch.setattr(kv_sizing, "read_device_memory", lambda device: DeviceMemory(total, used))
    cfg = _cuda_config(gpu_memory_utilization=0.8)
    assert cfg.blocks_per_rank(LLAMA8B) is None  # decided on the rank
    reserve = kv_sizing.reserve_for(cfg, LLAMA8B, total)
    bpb = bytes_per_block(LLAMA8B, torch.bfloat16, 16)
    expect = (int(total * 0.8) - used - reserve) // bpb
    seen = []
    got = kv_sizing.rank_kv_blocks(cfg, LLAMA8B, torch.device("cuda", 0), agree=lambda n: seen.append(n) or n - 3)
    assert seen == [expect] and got == expect - 3  # the minimum over ranks is the caller's (agree)
    assert expect * 16 > 500_000  # ~100 GiB of KV: far more than the old 1 GiB default
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_sizing.rank_kv_blocks(cfg, LLAMA8B, torch.device("cuda", 0), agree=lambda n: 0)


def test_graph_max_tokens_by_device_memory() -> None:
    """cuda_graph_max_tokens=None: 1,024 where the graphs' static buffers fit 5 % of the device, else
    512 or 256; a set value is kept. The pool's reserve counts the same buckets."""
    from conflux_cluster.engine.runtime.cuda_graphs import default_buckets

    cfg = _cuda_config()
    per_token = kv_sizing.graph_bytes_per_token(LLAMA8B, 2)
    assert per_token * sum(default_buckets(1024)) > 4 * GiB  # Llama-3.1-8B in bf16: 4.1 GiB of buffers
    assert kv_sizing.graph_max_tokens(cfg, LLAMA8B, 140 * GiB) == 1024  # an H200
    assert kv_sizing.graph_max_tokens(cfg, LLAMA8B, 40 * GiB) == 512
    assert kv_sizing.graph_max_tokens(cfg, LLAMA8B, 8 * GiB) == 256  # none fits: the smallest
    assert kv_sizing.graph_max_tokens(_cuda_config(cuda_graph_max_tokens=64), LLAMA8B, 140 * GiB) == 64
    big, small = kv_sizing.reserve_for(cfg, LLAMA8B, 140 * GiB), kv_sizing.reserve_for(cfg, LLAMA8B, 40 * GiB)
    assert big - small == per_token * (sum(default_buckets(1024)) - sum(default_buckets(512)))


def test_fixed_sizes_skip_the_measurement(monkeypatch) -> None:
    def no_reader(device):
        raise AssertionError("fixed sizes must not read device memory")

    monkeypatch.setattr(kv_sizing, "read_device_memory", no_reader)
    dev = torch.device("cuda", 0)
    assert kv_sizing.rank_kv_blocks(_cuda_config(num_kv_blocks=77), LLAMA8B, dev) == 77
    got = kv_sizing.rank_kv_blocks(_cuda_config(kv_cache_memory_gb=2.0), LLAMA8B, dev)
    assert got == blocks_for_budget(LLAMA8B, torch.bfloat16, 16, 2 * GiB)


def test_cpu_default_unchanged() -> None:
    """CPU: 1 GiB per rank, exactly the block count of the old default (kv_cache_memory_gb=1.0)."""
    src = resolve_model("tiny-llama")
    cfg = EngineConfig(model="tiny-llama", load_progress=False)
    old = blocks_for_budget(src.config, torch.float32, 16, 2**30)
    assert cfg.kv_cache_memory_gb is None and cfg.blocks_per_rank(src.config) == old
    assert EngineConfig(model="tiny-llama", kv_cache_memory_gb=1.0).blocks_per_rank(src.config) == old
    ex = LocalExecutor(cfg, src)
    assert ex.blocks_per_rank == ex.worker.kv.num_blocks == old
    assert "CPU default" in cfg.kv_sizing_rule()


def test_config_bounds_name_the_field() -> None:
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        EngineConfig(kv_cache_memory_gb=0)


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_pool_context_limit_matches_scheduler_admission(num_ranks: int) -> None:
    """The longest context the cap allows is admitted by Scheduler.add; one block's worth more is not."""
    mc = PRESETS["tiny-llama"]
    sched = SchedulerConfig(policy="fcfs", estimator_profile="budget")
    cfg = EngineConfig(model="tiny-llama", block_size=4, num_ranks=num_ranks, scheduler=sched)
    blocks = 40
    fit = cfg.pool_context_limit(mc, blocks)
    assert 0 < fit < mc.max_position_embeddings
    s = Scheduler(sched, cfg.kv_layout(mc), blocks)
    s.add(SchedRequest("fits", fit - 1, 1, 0.0, 1.0))
    with pytest.raises(ValueError):
        s.add(SchedRequest("too-long", fit + 4, 1, 0.0, 1.0))


def test_context_limit_caps_or_rejects(caplog) -> None:
    mc = PRESETS["tiny-llama"]  # 2048-token context
    cfg = EngineConfig(model="tiny-llama", block_size=4)
    assert cfg.context_limit(mc) == 2048 and cfg.context_limit(mc, 100_000) == 2048
    fit = cfg.pool_context_limit(mc, 64)  # one rank: ceil(L / 4) <= 64 (its decode takes over the prompt's blocks)
    assert fit == 256
    two = EngineConfig(model="tiny-llama", block_size=4, num_ranks=2)  # decode rank: the whole context + a shard
    assert two.pool_context_limit(mc, 64) == 169  # ceil(L / 4) + ceil((L - 1) / 8) <= 64
    with caplog.at_level(logging.WARNING, logger="conflux_cluster.engine.config"):
        assert cfg.context_limit(mc, 64) == 256
    assert "max_model_len" in caplog.text and "gpu_memory_utilization" in caplog.text
    explicit = EngineConfig(model="tiny-llama", block_size=4, max_model_len=1024)
    with pytest.raises(ValueError, match="max_model_len=1024.*gpu_memory_utilization"):
        explicit.context_limit(mc, 64)
    assert EngineConfig(model="tiny-llama", block_size=4, max_model_len=100).context_limit(mc, 64) == 100
    with pytest.raises(ValueError, match="max_model_len"):
        two.context_limit(mc, 1)  # no request fits at all (2 ranks: a decode block and a shard block)


def test_max_model_len_past_the_models_context_is_a_config_error() -> None:
    """Not capped silently (vLLM refuses it too): the error names max_model_len and the model's context,
    at config level and when the engine is built."""
    from conflux_cluster import LLM

    mc = PRESETS["tiny-llama"]  # 2048-token context
    assert EngineConfig(model="tiny-llama", max_model_len=2048).context_limit(mc) == 2048
    with pytest.raises(ValueError, match=r"max_model_len=4096 is longer than the model's context \(2048 tokens"):
        EngineConfig(model="tiny-llama", max_model_len=4096).context_limit(mc, 100_000)
    with pytest.raises(ValueError, match="max_model_len=2049"):
        LLM(model="tiny-llama", max_model_len=2049, load_progress=False, num_kv_blocks=64)


def test_engine_core_uses_the_executor_pool(caplog) -> None:
    from conflux_cluster.engine.core import EngineCore
    from conflux_cluster.engine.tokenizer import ByteTokenizer

    src = resolve_model("tiny-llama")
    cfg = EngineConfig(model="tiny-llama", block_size=4, num_kv_blocks=64, load_progress=False,
                       scheduler=SchedulerConfig(policy="fcfs", estimator_profile="budget"))
    core = EngineCore(cfg, LocalExecutor(cfg, src), source=src, tokenizer=ByteTokenizer())
    assert core.blocks_per_rank == 64 and core.max_model_len == 256
    text = cfg.describe(src.config, core.blocks_per_rank, core.max_model_len)
    assert "64 blocks/rank x 4 tokens = 256 tokens/rank" in text and "max_model_len  256" in text
    assert "policy=fcfs" in text and "cuda graphs    off" in text


def test_gpu_token_budget_default_and_explicit_value_kept():
    from conflux_cluster.engine.config import GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
    from conflux_cluster.engine.scheduler.config import SchedulerConfig

    assert EngineConfig(device="cuda").scheduler.max_num_batched_tokens == GPU_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig(device="cpu").scheduler.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    explicit = SchedulerConfig(max_num_batched_tokens=64)
    assert EngineConfig(device="cuda", scheduler=explicit).scheduler.max_num_batched_tokens == 64
