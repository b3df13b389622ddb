"""Discrete-event simulator of ConfluxServe and the paper's baselines (goodput evaluation).

    from conflux_cluster.sim import Setting, get_model, get_hardware, SLO, make_workload
    from conflux_cluster.sim.evaluate import evaluate
    s = Setting(get_model("llama-8b"), get_hardware("h200"), num_gpus=4, base_tp=1, slo=SLO(1.0, 0.05))
    results = evaluate(s, make_workload("toolagent", 300), ["conflux", "chunked++"])

(The functions ``evaluate`` and ``goodput`` are not re-exported here: their modules share the names.)

ConfluxServe runs the engine's own ``Scheduler`` (``conflux_cluster.engine.scheduler``) timed by
its ``LatencyEstimator``; see docs/simulator.md for the models, their assumptions and results.
"""

from conflux_cluster.slo import SLO

from .core import Event, EventKind, EventQueue, Recorder, SimInstance, Simulation
from .costs import ComponentCosts, xp_profile
from .goodput import search_threshold
from .hardware import get_hardware, get_model
from .metrics import RequestRecord, attainment, summarize
from .registry import ALL_SYSTEMS, Setting, SystemConfig, sweep
from .workloads import SimRequest, Workload, cap_lengths, load_trace, make_workload, scale_to_rate, toolagent_like

__all__ = ["ALL_SYSTEMS", "ComponentCosts", "Event", "EventKind", "EventQueue", "Recorder", "RequestRecord", "SLO",
           "Setting", "SimInstance", "SimRequest", "Simulation", "SystemConfig", "Workload", "attainment",
           "cap_lengths", "get_hardware", "get_model", "load_trace", "make_workload", "scale_to_rate", "search_threshold", "summarize", "sweep", "toolagent_like",
           "xp_profile"]
