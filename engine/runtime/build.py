"""How one device builds its ``RankWorker`` (in process, in a spawned worker or in a rank actor).

Device ``w = r * k + t`` (logical rank r, TP index t) runs the engine's ordinary ``RankWorker``
with two XP pieces plugged in: the model cut to TP shard t (``tp.apply_tp``) and ``XPAttention``
over the worker's own KV pool (aliased: same tensors, head-sharded and decode views).
"""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..kv.sizing import rank_kv_blocks
from ..loader import ModelSource, load_model
from ..xp.attention import XPAttention
from ..xp.comm import XPGroups
from ..xp.heads import DeviceHeads
from ..xp.kv import XPKVCache
from ..xp.modes import XPMode
from ..xp.spec import XPInstanceSpec
from ..xp.tp import apply_tp
from .worker import RankWorker


def _load(spec: XPInstanceSpec, device: torch.device) -> torch.nn.Module:
    cfg = spec.config
    if spec.weights is None:
        return load_model(spec.source, cfg.torch_dtype(), device, progress=False, seed=cfg.seed)
    from ..models.weights import build_empty

    model = build_empty(spec.source.config, cfg.torch_dtype(), device)
    model.load_state_dict(torch.load(spec.weights, map_location="cpu", mmap=True, weights_only=True))
    return model.eval()


def _min_over_world(n: int) -> int:
    """All-reduce MIN of one count over the instance's process group (every device calls it)."""
    import torch.distributed as dist

    backend = dist.get_backend()
    t = torch.tensor([n], dtype=torch.int64, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def build_rank_worker(spec: XPInstanceSpec, world_rank: int) -> RankWorker:
    """Device ``world_rank``'s RankWorker with XP attention (call after joining the process group)."""
    cfg = spec.config
    cfg.require_device(index=False)  # the device index is this rank's, below
    groups = XPGroups.create(cfg.num_ranks, cfg.tp_size) if spec.world_size > 1 else XPGroups.single()
    if cfg.on_cuda:
        device = torch.device("cuda", world_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        cfg = cfg.model_copy(update={"device_index": device.index})
    else:
        device = torch.device("cpu")
    mc = spec.source.config
    model = _load(spec, device)
    heads = DeviceHeads.build(mc.num_attention_heads, mc.num_key_value_heads, cfg.num_ranks, cfg.tp_size,
                              groups.rank, groups.tp_rank)
    apply_tp(model, heads, groups.tp_rank, cfg.tp_size, groups.tp)
    # the pool is sized now that this device's weights are in place; every device takes the minimum
    blocks = rank_kv_blocks(cfg, mc, device, agree=_min_over_world if spec.world_size > 1 else lambda n: n)
    cfg = cfg.model_copy(update={"num_kv_blocks": blocks})

    def attention_factory(pool) -> XPAttention:  # pool: the worker's KVCache (one physical pool)
        kv = XPKVCache(mc.num_hidden_layers, pool.num_blocks, cfg.block_size, heads.num_kv,
                       heads.sp_shard.num_kv, mc.head_dim, pool.k.dtype, device, pool=(pool.k, pool.v))
        return XPAttention(heads, kv, groups, mc.head_dim ** -0.5, XPMode(cfg.xp_mode),
                           max_history=cfg.max_model_len or mc.max_position_embeddings)

    return RankWorker(cfg, rank=groups.rank, source=spec.source, model=model,
                      attention_factory=attention_factory)


def local_worker(config: EngineConfig, source: ModelSource) -> RankWorker:
    """The worker of a one-device instance. On CUDA: the XP backend with one rank (Triton paged
    decode, row-copy KV writes, flash prefill; no process group). Elsewhere: the torch paged
    backend, which is also the reference the XP backends are tested against."""
    if config.on_cuda and config.num_ranks * config.tp_size == 1:
        return build_rank_worker(XPInstanceSpec(config, source), 0)
    return RankWorker(config, rank=0, source=source)
