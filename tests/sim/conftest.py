"""Toy cost model with round numbers, so expected token times can be computed by hand."""

from __future__ import annotations

import pytest

from conflux_cluster.engine.scheduler.estimator import Affine
from conflux_cluster.sim.costs import ComponentCosts
from conflux_cluster.engine.scheduler.roofline import HardwareSpec
from conflux_cluster.sim.hardware import ModelSpec, SimHardware

TOY_MODEL = ModelSpec("toy", num_layers=1, hidden=64, num_q_heads=4, num_kv_heads=2, head_dim=16, ffn=128,
                      vocab=100, max_context=4096)
TOY_HW = SimHardware(HardwareSpec("toy", peak_flops=1e15, hbm_bandwidth=1e12, link_bandwidth=1e30,
                                  collective_latency=0.0), hbm_bytes=1e9, allreduce_latency=0.0,
                     step_overhead=0.0, activation_reserve=0.0)


def toy_costs(tp: int = 1) -> ComponentCosts:
    """One layer; gemm(n) = 10 ms + 0.1 ms·n; attention, LM head, comm and overheads cost 0."""
    zero = Affine(0.0, 0.0)
    return ComponentCosts(TOY_MODEL, TOY_HW, tp, gemm=Affine(1e-4, 1e-2), prefill_attn=zero, decode_attn=zero,
                          lm_head=zero, a2a_full=zero, alpha=1.0, beta=1.0, source="toy")


@pytest.fixture
def costs() -> ComponentCosts:
    return toy_costs()
