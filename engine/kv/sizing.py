"""How many KV blocks a CUDA rank's pool gets: decided on the rank, after its weights are loaded.

    total device memory x gpu_memory_utilization
    ├── in use now      total - free (torch.cuda.mem_get_info): weights, CUDA context, other processes
    ├── reserve         activation_reserve_bytes: the largest step, CUDA graph buffers, sampling, misc
    └── KV pool         the rest, in whole blocks of bytes_per_block

The ranks of one instance must then agree on ONE count (the scheduler mirrors every rank's
allocator): the caller passes ``agree`` (an all_reduce MIN over the instance's group).
Fixed sizes (``num_kv_blocks``, ``kv_cache_memory_gb``, the CPU default) skip all of this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from ..config import EngineConfig
from ..models.config import ModelConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

GiB = 2**30
# NCCL communicators (created after the pool is sized), cuBLAS workspaces, the attention backends'
# gathers and scratch (TorchPagedAttention's decode gathers B x longest context of K and V), fragmentation
MISC_RESERVE_BYTES = 2 * GiB
# cuda_graph_max_tokens=None: the largest of these whose graphs' static buffers fit GRAPH_MEMORY_SHARE
# of the device (1,024 is 4.4 GiB for Llama-3.1-8B in bf16: 3 % of an H200, 11 % of a 40 GB A100)
AUTO_GRAPH_MAX_TOKENS = (1024, 512, 256)
GRAPH_MEMORY_SHARE = 0.05


@dataclass(frozen=True)
class DeviceMemory:
    """One device, in bytes."""

    total: int
    used: int  # total - free: every process on the device, CUDA context included


@dataclass(frozen=True)
class KVSizing:
    """The numbers behind one rank's pool size (for the log)."""

    memory: DeviceMemory
    utilization: float  # gpu_memory_utilization
    reserve: int  # activation_reserve_bytes
    bytes_per_block: int

    @property
    def budget(self) -> int:
        """Bytes the pool may take (negative: not even the reserve fits)."""
        return int(self.memory.total * self.utilization) - self.memory.used - self.reserve

    @property
    def blocks(self) -> int:
        return max(0, self.budget // self.bytes_per_block)

    def describe(self) -> str:
        m = self.memory
        return (f"{m.total / GiB:.1f} GiB x {self.utilization:g} - {m.used / GiB:.2f} GiB in use - "
                f"{self.reserve / GiB:.2f} GiB activation reserve = {self.budget / GiB:.2f} GiB -> "
                f"{self.blocks} blocks of {self.bytes_per_block} bytes")


def activation_reserve_bytes(model: ModelConfig, dtype_bytes: int, step_tokens: int, sampled_rows: int,
                             graph_buckets: Sequence[int] = ()) -> int:
    """Memory one rank needs beyond weights and KV for its largest step (generous, not exact).

    With H = hidden, I = intermediate, Q = H_q * D, KV = H_kv * D, L = layers, V = vocab, e = dtype bytes::

        per_token   = e * (4H + 3(Q + 2KV) + 3I)        live tensors of one layer, per token row:
                                                          residual, normed input, attention out, o_proj out;
                                                          qkv out, q/k after RoPE, XP all-to-all send+recv;
                                                          gate_up out (2I) and SiLU(gate)*up (I)
        activations = per_token * T                     T = max(step_tokens, largest graph bucket)
        graphs      = e * L * (2Q + 2KV + H + 2D) * sum(graph_buckets)
                                                          static buffers kept per (segment, bucket):
                                                          q, k, v, residual, cos, sin, attention input
        sampling    = 4 * 3 * sampled_rows * V          float32 logits, softmax, top-p sort
        reserve     = activations + graphs + sampling + MISC_RESERVE_BYTES (2 GiB)

    Llama-3.1-8B in bf16, 256-token fixed budget, graphs up to 512 tokens, 256 sampled rows:
    0.07 + 1.22 + 0.37 + 2 = 3.7 GiB (6.0 GiB with the estimator's 16384-token ceiling; graphs up to
    1,024 tokens add 2.9 GiB). Measured on
    an H200 (2048-token budget, 64 requests of 0.7k-5k tokens, one rank): 2.7 GiB allocated beyond
    weights and KV at the peak, of which ~1.3 GiB were the eager decode path's K/V gathers.
    """
    h, i, q, kv = model.hidden_size, model.intermediate_size, model.q_size, model.kv_size
    per_token = dtype_bytes * (4 * h + 3 * (q + 2 * kv) + 3 * i)
    tokens = max([step_tokens, *graph_buckets])
    graphs = graph_bytes_per_token(model, dtype_bytes) * sum(graph_buckets)
    sampling = 4 * 3 * sampled_rows * model.vocab_size
    return per_token * tokens + graphs + sampling + MISC_RESERVE_BYTES


def graph_bytes_per_token(model: ModelConfig, dtype_bytes: int) -> int:
    """Static graph buffers per captured token row (``activation_reserve_bytes``' ``graphs`` term)."""
    return dtype_bytes * model.num_hidden_layers * (2 * model.q_size + 2 * model.kv_size + model.hidden_size
                                                    + 2 * model.head_dim)


def graph_max_tokens(config: EngineConfig, model: ModelConfig, device_total: int) -> int:
    """The largest captured token count: ``cuda_graph_max_tokens``, or (None) the largest of
    ``AUTO_GRAPH_MAX_TOKENS`` whose buckets' static buffers take at most ``GRAPH_MEMORY_SHARE`` of
    ``device_total`` bytes (the smallest where none does). The rank and its pool sizing both ask."""
    from ..runtime.cuda_graphs import default_buckets

    if config.cuda_graph_max_tokens is not None:
        return config.cuda_graph_max_tokens
    per_token = graph_bytes_per_token(model, config.torch_dtype().itemsize)
    for cap in AUTO_GRAPH_MAX_TOKENS:
        if per_token * sum(default_buckets(cap)) <= GRAPH_MEMORY_SHARE * device_total:
            return cap
    return AUTO_GRAPH_MAX_TOKENS[-1]


def step_tokens(config: EngineConfig) -> int:
    """Most token rows one rank's forward can see: the scheduler's per-rank budget n_target (the
    waterfill search's ceiling ``max_level`` when the estimator picks it)."""
    s = config.scheduler
    return s.max_level if s.uses_estimator() else s.max_num_batched_tokens


def reserve_for(config: EngineConfig, model: ModelConfig, device_total: int) -> int:
    """``activation_reserve_bytes`` for an engine config (its dtype, budgets and CUDA graph buckets) on a
    device of ``device_total`` bytes."""
    from ..runtime.cuda_graphs import default_buckets

    buckets = (default_buckets(graph_max_tokens(config, model, device_total)) if config.cuda_graphs_enabled()
               else ())
    tokens = step_tokens(config)
    dtype_bytes = config.torch_dtype().itemsize
    return activation_reserve_bytes(model, dtype_bytes, tokens, min(tokens, config.scheduler.max_num_seqs), buckets)


def read_device_memory(device: torch.device) -> DeviceMemory:
    """Total and in-use memory of a CUDA device, after returning this process's cached free blocks."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, used=total - free)


def measure(config: EngineConfig, model: ModelConfig, device: torch.device) -> KVSizing:
    from .cache import bytes_per_block

    memory = read_device_memory(device)
    return KVSizing(memory, config.gpu_memory_utilization, reserve_for(config, model, memory.total),
                    bytes_per_block(model, config.torch_dtype(), config.block_size))


def rank_kv_blocks(config: EngineConfig, model: ModelConfig, device: torch.device,
                   agree: Callable[[int], int] = lambda n: n) -> int:
    """Blocks of this rank's pool: the config's fixed count, or measured now (call after loading the
    weights). ``agree(n)``: the minimum over the instance's ranks (every rank calls it, also with n = 0)."""
    fixed = config.blocks_per_rank(model)
    if fixed is not None:
        return fixed
    sizing = measure(config, model, device)
    n = agree(sizing.blocks)
    log.info("KV pool on %s: %s; %d blocks (%d tokens) after agreeing with the other ranks",
             device, sizing.describe(), n, n * config.block_size)
    if n < 1:
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization:g} leaves no room for a KV block "
                         f"on {device} ({sizing.describe()}; the smallest over the ranks: {n}); raise "
                         "gpu_memory_utilization, free the device, or set kv_cache_memory_gb / num_kv_blocks")
    return n
