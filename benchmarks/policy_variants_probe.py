"""One-off probe (issue 39): slo variants in the simulator against fcfs on the policy-matrix shapes.

    SHAPES=uniform FACTORS=1,1.25 python benchmarks/policy_variants_probe.py fcfs,slo-paper,slo 1.0
    python benchmarks/policy_variants_probe.py slo 0.7     # the planning estimator 30 % optimistic
    python benchmarks/policy_variants_probe.py slo,slo-x2 1.0 '{"slo-x2": {"policy": "slo", "token_budget": "estimator", "max_step_stretch": 2.0}}'

argv: variant names, the planning profile's scale (drift), extra variants as JSON. Results recorded in
docs/scheduler.md; removed from the tree in the next commit."""
import sys, json
from dataclasses import replace
from conflux_cluster.bench import policy_matrix as pm
from conflux_cluster.engine.scheduler.config import SchedulerConfig
from conflux_cluster.sim.systems.engine_sched import XPInstance
from conflux_cluster.sim.goodput_bound import scaled_profile
from conflux_cluster.sim.registry import SLO_MARGIN

st = pm.sim_setting("engine/scheduler/profiles/h200-llama-3.1-8b-n1.json", 1.0, 0.1)
drift = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
plan = scaled_profile(st.profile, drift) if drift != 1.0 else None
lim = st.limits
VARIANTS = {
  "fcfs": dict(policy="fcfs", token_budget="fixed"),
  "slo-paper": dict(policy="slo", token_budget="estimator", deferred_wait_factor=1000, admission_fallback_accuracy=0.0),
  "slo-nofb": dict(policy="slo", token_budget="estimator", admission_fallback_accuracy=0.0),
  "slo": dict(policy="slo", token_budget="estimator"),
}
extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
for k, v in extra.items(): VARIANTS[k] = v
def factory(kw):
    cfg = SchedulerConfig(max_num_batched_tokens=lim.max_num_batched_tokens, max_num_seqs=lim.max_num_seqs,
                          max_level=lim.max_level, ttft_slo=1.0, tbt_slo=0.1, slo_margin=SLO_MARGIN,
                          enable_prefix_caching=False, refit_every=0, **kw)
    return lambda rec: XPInstance(rec, st.costs(), 1, cfg, st.slo, st.profile, plan, pipelined=lim.pipelined)
names = sys.argv[1].split(",")
import os
SH = os.environ.get("SHAPES", "uniform,conversation,bursty,longmix").split(",")
FA = [float(x) for x in os.environ.get("FACTORS", "1,1.25,1.5").split(",")]
for shape_name, factors in ((s_, FA) for s_ in SH):
    shape = pm.SHAPES[shape_name]
    for f in factors:
        res = {}
        for n in names:
            a=[];t=[]
            for seed in (1,2,3):
                wl = pm.shape_workload(shape, f*shape.knee, 60, seed)
                p = pm.sim_point(factory(VARIANTS[n]), wl, st.slo)
                a.append(p["attainment"]); t.append(p["ttft_p99"])
            res[n] = f"{100*sum(a)/3:5.1f}% p99 {sum(t)/3:5.2f}s"
        print(f"drift {drift} {shape_name:12s} {f:4}x  " + " | ".join(f"{n}: {v}" for n,v in res.items()), flush=True)
