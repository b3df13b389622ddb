"""ConfluxServe's benchmarks: a few maintained entry points, run from the repository root as
``python -m benchmarks.<entry> ...`` (``-h`` for the flags). They print numbers and ratios, write
JSON with ``--out``, and judge nothing by time.
A flat module (``benchmarks/gpu_serve.py``) also runs by its path, as it imports only
``conflux_cluster``; a folder (``steps``, ``simulator``, ``step_logs``) runs only with ``-m``.

Serving, through ``conflux serve`` and HTTP:
    gpu_serve            first request, burst, 128K prompt, rate sweep, offline ratio, roofline
    burst                refusals under a burst, and what the served requests' TTFT paid for them
    overload             N requests at once against any OpenAI-compatible server
    bursty               a bursty open workload: trace, serve, report
    structured_overhead  decode TPOT of grammar-constrained requests against free-form ones
    failover             time to the first success after a rank kill
    faults               rank kill, disconnect storm, KV pressure, soak (helpers: fault_helpers)

Goodput:
    gpu_goodput          served goodput of ConfluxServe and the baselines, beside the simulator
    policy_matrix        --policy slo against fcfs over workload shapes and rates (--sim: simulator)

Steps, scheduler, simulator, offline:
    steps                trace | buckets | chunks | xp | decode-kernel | prefill-history
    bench_scheduler      scheduling time per iteration against the pending-queue depth
    simulator            goodput | resimulate | bound
    step_logs            stats | estimator | refit   (on ``conflux serve --step-log`` files)
    bench_engine_cpu     offline throughput on CPU against HF transformers

Shared code: ``conflux_cluster.bench`` (server processes, workloads, client, reports, roofline) and
``benchmarks.common`` (the subcommand runner). One-off probes are removed once their result is in
docs/results/LOG.md, which names the commit that removed each one.
"""
