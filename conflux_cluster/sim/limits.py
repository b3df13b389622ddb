"""The limits the simulator models, taken from the engine's configuration (one source of truth).

    decode slots   SchedulerConfig.max_num_seqs: requests decoding at once on ONE engine instance
    token budget   SchedulerConfig.max_num_batched_tokens as EngineConfig sets it on a GPU (2048 per
                   rank and step): the fixed budget of the chunked-prefill baselines' default config
    KV capacity    EngineConfig.gpu_memory_utilization of each GPU's HBM, less weights and the
                   activation reserve (``hardware.kv_tokens_per_group``), in blocks of block_size
    pipelining     on request (``pipelined``; gpu_goodput and resimulate set it from the served
                   engine's EngineConfig.async_scheduling): the next step is planned before this
                   one's tokens are back, so a request's first decode sits out the step after its
                   transition (``Scheduler.defer_first_decode``). Off for ``conflux simulate``,
                   whose systems model engines that feed a sampled token straight to the next step

Every system gets the same limits *per GPU* (the real systems here are all this engine, or modelled
on it): an instance of G GPUs has ``max_num_seqs`` decode slots, and a group of g of its GPUs that
runs its own decode batch (a DistServe decode replica, a LoongServe elastic instance) gets the share
``max_num_seqs · g / G``. Differences that the real systems have are documented in docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conflux_cluster.engine.config import EngineConfig

from .hardware import SimHardware


@dataclass(frozen=True)
class EngineLimits:
    """Per-instance limits of the engine (defaults: ``EngineConfig(device="cuda")``'s)."""

    max_num_seqs: int  # decode slots of one instance (all its GPUs)
    max_num_batched_tokens: int  # fixed token budget per rank and step
    gpu_memory_utilization: float  # fraction of HBM the engine may use (weights + activations + KV)
    block_size: int  # KV block size (tokens) of the scheduler's accounting
    max_level: int  # highest per-rank n_target the waterfill search tries
    pipelined: bool = False  # the engine plans one step ahead, deferring first decodes (served: async_scheduling)

    @classmethod
    def from_engine(cls, config: EngineConfig | None = None, **overrides: int | float | bool) -> "EngineLimits":
        """From an engine configuration (default: the GPU defaults), with ``overrides`` by field name
        (``None`` values are ignored, so CLI flags can be passed as they are)."""
        cfg = config or EngineConfig(device="cuda")
        s = cfg.scheduler
        limits = cls(s.max_num_seqs, s.max_num_batched_tokens, cfg.gpu_memory_utilization, cfg.block_size,
                     s.max_level)
        return replace(limits, **{k: v for k, v in overrides.items() if v is not None})

    def decode_slots(self, gpus: int, instance_gpus: int) -> int:
        """Decode slots of a group of ``gpus`` of an instance's ``instance_gpus`` GPUs (same per GPU)."""
        if not 0 < gpus <= instance_gpus:
            raise ValueError(f"a group of {gpus} GPUs of an instance of {instance_gpus}")
        return max(1, self.max_num_seqs * gpus // instance_gpus)

    def hardware(self, hw: SimHardware) -> SimHardware:
        """``hw`` with the engine's memory share (KV capacity is computed from it)."""
        return replace(hw, mem_util=self.gpu_memory_utilization)
