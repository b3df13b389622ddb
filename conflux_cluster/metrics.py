"""Prometheus metrics exported by ConfluxServe, through Ray's metrics agent.

Every metric is a ``ray.util.metrics`` Counter / Gauge / Histogram, so it is scraped from each
node's Ray metrics-export port exactly like Ray Serve's own metrics. Ray's exporter prefixes the
name with ``ray_`` and suffixes counters with ``_total``:

    name passed to Ray                  series Prometheus stores
    ----------------------------------  ------------------------------------------------------
    Counter   vllm_prompt_tokens        ray_vllm_prompt_tokens_total
    Gauge     vllm_num_requests_running ray_vllm_num_requests_running
    Histogram conflux_iteration_...     ray_conflux_iteration_..._bucket / _sum / _count

Names that vLLM also exports keep vLLM's name with ``:`` replaced by ``_`` — exactly what Ray Serve
LLM exports for vLLM engines (``vllm:time_to_first_token_seconds`` →
``ray_vllm_time_to_first_token_seconds``), so existing vLLM/Ray-Serve-LLM queries work. Metrics
without a vLLM counterpart start with ``conflux_``.

Ray (2.5x, OpenTelemetry export) forwards histograms as bucket counts and rebuilds ``_sum`` from
bucket midpoints, so ``_sum / _count`` of a histogram is only an approximation. Quantities whose
exact totals matter (iteration time measured vs estimated, control-plane time, per-rank tokens)
are therefore Counters; histograms are for distributions (quantiles over ``_bucket``).

Tag keys (labels) — ``instance`` is deliberately NOT used: Prometheus attaches its own
``instance`` label (the scrape target) to every series and would rename ours to
``exported_instance``. The XP instance is therefore ``xp_instance``.

    model_name      served model name (vLLM's label name)
    engine          the engine's index, as vLLM labels every engine series (one engine per XP
                    instance: its index "0".."K-1"; Ray Serve LLM dashboards group by it)
    xp_instance     XP instance id (one per node; the router's instance id)
    rank            logical rank index inside the XP instance, "0".."N-1"
    finished_reason "stop" | "length" | "abort" | ... (vLLM's label on request_success)
    router_policy   the global router's policy name
    code            HTTP status code of a rejected request

Usage (inside the XP-instance replica / instance loop)::

    m = InstanceMetrics(model_name="smollm2", instance_id="xp-0", num_ranks=2,
                        slo=SLO(ttft_s=1.0, tbt_s=0.1))
    m.on_request_arrival("r1", num_prompt_tokens=37)
    ... each iteration:
    m.record_iteration(IterationSample(measured_s=0.041, estimated_s=0.038,
                                       prefill_tokens=[128, 128], decode_tokens=[3, 2]))
    m.record_queue(num_running=5, num_waiting=2, kv_cache_usage=0.31)
    m.on_tokens("r1", 1, scheduled_at=t_sched)  # per token delta; t_sched: when first scheduled
    m.on_request_finished("r1", "stop")

All objects are created per ``InstanceMetrics`` / ``RouterMetrics`` / ``IngressMetrics`` instance
(nothing is created at import). Ray must be initialised (any Ray worker, actor or Serve replica is)
before constructing one. The pure helpers (``judge_slo``, ``METRIC_SPECS``,
``exported_series_names``) need no Ray.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping, Sequence

from conflux_cluster.engine.contracts.request import priority_bucket
from conflux_cluster.slo import SLO, SLOJudgement, token_deadlines_met

# Ray's exporter adds this prefix to every application metric.
RAY_PREFIX = "ray_"

# ----------------------------------------------------------------------------------- tag keys
MODEL = "model_name"
ENGINE = "engine"
XP_INSTANCE = "xp_instance"
RANK = "rank"
FINISHED_REASON = "finished_reason"
ROUTER_POLICY = "router_policy"
CODE = "code"
PRIORITY = "priority"  # a request's priority, bucketed: "-10".."10", "<-10", ">10" (priority_bucket)

ABORT = "abort"  # finished_reason of a request the client cancelled (not SLO-judged)

INSTANCE_TAGS: tuple[str, ...] = (MODEL, ENGINE, XP_INSTANCE)
RANK_TAGS: tuple[str, ...] = (MODEL, ENGINE, XP_INSTANCE, RANK)

# ------------------------------------------------------------------------------------ buckets
# Seconds. vLLM's buckets, extended downwards because CPU/small-model iterations are short.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
ROUTER_BUCKETS = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001,
                  0.0025, 0.01, 0.1)
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
TOKEN_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0,
                 4096.0, 8192.0, 16384.0, 32768.0, 65536.0, 131072.0)


class MetricKind(str, Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its Ray name, kind, meaning and labels."""

    name: str  # name given to ray.util.metrics (no "ray_" prefix, no "_total" suffix)
    kind: MetricKind
    description: str  # shown as # HELP; also the meaning documented in docs/operations.md
    tag_keys: tuple[str, ...]
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds (all > 0)
    vllm_name: str | None = None  # the vLLM metric this mirrors, e.g. "vllm:prompt_tokens"
    scope: str = "instance"  # who records it: "instance" | "router" | "ingress"

    @property
    def prometheus_name(self) -> str:
        """The base name in Prometheus: ``ray_<name>`` (+ ``_total`` for counters)."""
        base = RAY_PREFIX + self.name
        return base + "_total" if self.kind is MetricKind.COUNTER else base

    def series_names(self) -> tuple[str, ...]:
        """Every series name a PromQL query may use for this metric."""
        if self.kind is MetricKind.HISTOGRAM:
            base = RAY_PREFIX + self.name
            return (base + "_bucket", base + "_sum", base + "_count")
        return (self.prometheus_name,)


def _c(name, desc, tags, vllm=None, scope="instance") -> MetricSpec:
    return MetricSpec(name, MetricKind.COUNTER, desc, tags, vllm_name=vllm, scope=scope)


def _g(name, desc, tags, vllm=None, scope="instance") -> MetricSpec:
    return MetricSpec(name, MetricKind.GAUGE, desc, tags, vllm_name=vllm, scope=scope)


def _h(name, desc, tags, buckets, vllm=None, scope="instance") -> MetricSpec:
    return MetricSpec(name, MetricKind.HISTOGRAM, desc, tags, buckets, vllm_name=vllm,
                      scope=scope)


_REASON_TAGS = INSTANCE_TAGS + (FINISHED_REASON,)

# The complete catalogue. Dashboards may reference only these (tests/ops checks it).
METRIC_SPECS: tuple[MetricSpec, ...] = (
    # --- request level, vLLM-compatible -------------------------------------------------------
    _c("vllm_request_success", "Finished requests, by finish reason (stop, length, abort).",
       _REASON_TAGS, "vllm:request_success"),
    _c("vllm_prompt_tokens", "Prompt tokens of admitted requests.", INSTANCE_TAGS,
       "vllm:prompt_tokens"),
    _c("vllm_generation_tokens", "Generated (output) tokens.", INSTANCE_TAGS,
       "vllm:generation_tokens"),
    _h("vllm_time_to_first_token_seconds", "Time from arrival to the first output token.",
       INSTANCE_TAGS, TTFT_BUCKETS, "vllm:time_to_first_token_seconds"),
    _h("vllm_inter_token_latency_seconds", "Time between consecutive token deltas of a request.",
       INSTANCE_TAGS, ITL_BUCKETS, "vllm:inter_token_latency_seconds"),
    _h("vllm_request_time_per_output_token_seconds",
       "Per request: (e2e - ttft) / (output tokens - 1).", INSTANCE_TAGS, ITL_BUCKETS,
       "vllm:request_time_per_output_token_seconds"),
    _h("vllm_e2e_request_latency_seconds", "Time from arrival to the last token.",
       INSTANCE_TAGS, E2E_BUCKETS, "vllm:e2e_request_latency_seconds"),
    _h("vllm_request_queue_time_seconds", "Time from arrival to the first scheduled prefill chunk (waiting).",
       INSTANCE_TAGS, E2E_BUCKETS, "vllm:request_queue_time_seconds"),
    _h("vllm_request_prefill_time_seconds", "Time from the first scheduled prefill chunk to the first output "
       "token.", INSTANCE_TAGS, E2E_BUCKETS, "vllm:request_prefill_time_seconds"),
    _h("vllm_request_decode_time_seconds", "Time from the first output token to the last.", INSTANCE_TAGS,
       E2E_BUCKETS, "vllm:request_decode_time_seconds"),
    _h("vllm_request_inference_time_seconds", "Time from the first scheduled prefill chunk to the last token "
       "(prefill + decode).", INSTANCE_TAGS, E2E_BUCKETS, "vllm:request_inference_time_seconds"),
    _h("vllm_request_prompt_tokens", "Prompt length of finished requests.", INSTANCE_TAGS,
       TOKEN_BUCKETS, "vllm:request_prompt_tokens"),
    _h("vllm_request_generation_tokens", "Output length of finished requests.", INSTANCE_TAGS,
       TOKEN_BUCKETS, "vllm:request_generation_tokens"),
    # --- instance state, vLLM-compatible ------------------------------------------------------
    _g("vllm_num_requests_running", "Requests running (scheduled) in the XP instance.",
       INSTANCE_TAGS, "vllm:num_requests_running"),
    _g("vllm_num_requests_waiting", "Requests waiting for (the rest of) their prefill.", INSTANCE_TAGS,
       "vllm:num_requests_waiting"),
    _g("vllm_kv_cache_usage_perc", "Fraction (0..1) of the instance's KV blocks in use.",
       INSTANCE_TAGS, "vllm:kv_cache_usage_perc"),
    _h("vllm_iteration_tokens_total", "Tokens (prefill + decode, all ranks) per iteration.",
       INSTANCE_TAGS, TOKEN_BUCKETS, "vllm:iteration_tokens_total"),
    _c("vllm_num_preemptions", "Requests preempted because their rank ran out of KV blocks (they "
       "recompute their prompt and outputs so far, then continue).", INSTANCE_TAGS, "vllm:num_preemptions"),
    _c("vllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (when their prefill "
       "starts).", INSTANCE_TAGS, "vllm:prefix_cache_queries"),
    _c("vllm_prefix_cache_hits", "Prompt tokens served by the prefix cache (not prefilled).", INSTANCE_TAGS,
       "vllm:prefix_cache_hits"),
    # --- ConfluxServe: iteration and ranks ----------------------------------------------------
    # Exact totals are counters: Ray rebuilds a histogram's _sum from bucket midpoints, so
    # means taken from histogram _sum/_count are only approximate.
    _c("conflux_iterations", "XP iterations run.", INSTANCE_TAGS),
    _c("conflux_iteration_measured_seconds", "Sum of measured iteration wall times.",
       INSTANCE_TAGS),
    _c("conflux_iteration_estimated_seconds",
       "Sum of the latency estimator's predictions (Eq. 2-12) for the same iterations.",
       INSTANCE_TAGS),
    _h("conflux_iteration_latency_seconds", "Measured wall time of one XP iteration.",
       INSTANCE_TAGS, ITER_BUCKETS),
    _h("conflux_iteration_estimate_ratio", "Measured / estimated iteration time.",
       INSTANCE_TAGS, RATIO_BUCKETS),
    _g("conflux_step_budget_scale",
       "The scheduler's calibration: measured / estimated time of recent prefill-carrying steps (its "
       "per-step budget is the TBT SLO over this; 1 = uncalibrated or exact).", INSTANCE_TAGS),
    _g("conflux_admission_accuracy",
       "Policy slo: share of admission's recent meets / misses predictions (Moore-Hodgson) that came true when "
       "the request's first token came (by its TTFT deadline or not); below the configured threshold the "
       "scheduler orders prefills first-come-first-served (engine/scheduler/outcomes.py).", INSTANCE_TAGS),
    _g("conflux_admission_fcfs_fallback",
       "Policy slo: 1 while admission's predictions go wrong and prefills are ordered first-come-first-served.",
       INSTANCE_TAGS),
    _g("conflux_estimator_refits",
       "Times the scheduler replaced its estimator profile with one refitted on its own served steps "
       "(refit_every; 0 = the profile it started with).", INSTANCE_TAGS),
    _c("conflux_control_plane_seconds",
       "Sum of per-iteration control-plane time (plan broadcast + result gather).",
       INSTANCE_TAGS),
    _c("conflux_rank_prefill_tokens", "Prefill tokens a rank processed (per-step mean: divide "
       "by conflux_iterations).", RANK_TAGS),
    _c("conflux_rank_decode_tokens", "Decode tokens a rank ran (one per resident decode per "
       "step).", RANK_TAGS),
    _g("conflux_rank_decode_context_tokens",
       "Aggregate decode context resident on a rank (sum of c_i over D_r).", RANK_TAGS),
    _g("conflux_rank_kv_cache_usage_perc", "Fraction (0..1) of a rank's KV blocks in use.",
       RANK_TAGS),
    # --- ConfluxServe: SLO attainment (paper §8 request-level definition) ---------------------
    _c("conflux_slo_requests", "Finished requests judged against the SLOs (aborted ones are "
       "not judged).", INSTANCE_TAGS),
    _c("conflux_slo_ttft_met", "Judged requests whose first token met the TTFT SLO.",
       INSTANCE_TAGS),
    _c("conflux_slo_tbt_met",
       "Judged requests whose tokens 2..n met arrival + TTFT_SLO + (i-1)*TBT_SLO.",
       INSTANCE_TAGS),
    _c("conflux_slo_met", "Judged requests meeting every token deadline (SLO-compliant).",
       INSTANCE_TAGS),
    # --- ConfluxServe: global router ----------------------------------------------------------
    _c("conflux_router_decisions", "Requests the global router sent to an XP instance.",
       (ROUTER_POLICY, XP_INSTANCE), scope="router"),
    _h("conflux_router_decision_seconds", "Time the router took to pick an instance.",
       (ROUTER_POLICY,), ROUTER_BUCKETS, scope="router"),
    _g("conflux_router_instance_load",
       "Normalized queued workload of an instance as the router last saw it.",
       (ROUTER_POLICY, XP_INSTANCE), scope="router"),
    # --- ingress ------------------------------------------------------------------------------
    _c("conflux_request_errors", "Requests rejected by the OpenAI ingress, by HTTP status.",
       (MODEL, CODE), scope="ingress"),
    _c("conflux_requests_by_priority", "Requests the OpenAI ingress sent on, by their priority (lower runs first).",
       (MODEL, PRIORITY), scope="ingress"),
)

SPECS_BY_NAME: Mapping[str, MetricSpec] = {s.name: s for s in METRIC_SPECS}


def exported_series_names() -> frozenset[str]:
    """Every Prometheus series name ConfluxServe can emit (``ray_…``, ``_total``, ``_bucket``…)."""
    return frozenset(n for s in METRIC_SPECS for n in s.series_names())


def _make(scope: str, default_tags: Mapping[str, str]) -> dict:
    """Create the Ray metric objects of one ``scope`` with the given default tags."""
    from ray.util import metrics as rm  # imported lazily: the catalogue above needs no Ray

    out = {}
    for s in METRIC_SPECS:
        if s.scope != scope:
            continue
        name = s.name
        if s.kind is MetricKind.COUNTER:
            m = rm.Counter(s.name, s.description, tag_keys=s.tag_keys)
        elif s.kind is MetricKind.GAUGE:
            m = rm.Gauge(s.name, s.description, tag_keys=s.tag_keys)
        else:
            m = rm.Histogram(s.name, s.description, list(s.boundaries), tag_keys=s.tag_keys)
        defaults = {k: v for k, v in default_tags.items() if k in s.tag_keys}
        if defaults:
            m.set_default_tags(defaults)
        out[name] = m
    return out


# How often a serving process re-sets its gauges when nothing changed them. Ray's metrics agent
# drops a gauge value its worker has not re-exported within two report intervals (20 s at Ray's
# default 10 s; measured on Ray 2.60: a gauge set once is gone from the export port after ~30 s), so
# an idle instance's KV use and queue gauges would vanish from Prometheus and its dashboards.
GAUGE_REFRESH_S = 5.0


class _Gauges:
    """Sets Ray gauges and remembers each series' last value, so ``refresh`` can set them again.
    Thread-safe (the engine thread sets, the event loop refreshes)."""

    def __init__(self, metrics: Mapping[str, object]) -> None:
        self._m = metrics
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()

    def set(self, name: str, value: float, tags: Mapping[str, str] | None = None) -> None:
        key = (name, tuple(sorted(tags.items())) if tags else ())
        with self._lock:
            self._last[key] = float(value)
            self._m[name].set(float(value), dict(tags) if tags else None)

    def refresh(self) -> int:
        """Set every remembered series to its last value again; returns how many."""
        with self._lock:
            items = list(self._last.items())
            for (name, tags), value in items:
                self._m[name].set(value, dict(tags) or None)
        return len(items)


def _inc(counter, value: float, tags: Mapping[str, str] | None = None) -> None:
    """Counter.inc that accepts 0 (Ray requires > 0) and rejects negatives."""
    if value < 0:
        raise ValueError(f"counter increment must be >= 0, got {value}")
    if value > 0:
        counter.inc(float(value), tags)


# ======================================================================================= SLOs
def judge_slo(arrival: float, token_times: Sequence[float], slo: SLO) -> SLOJudgement:
    """Judge one request. ``token_times[i]`` is when output token i+1 reached the client.

    Deadline of the i-th output token (1-based): ``arrival + TTFT_SLO + (i-1)·TBT_SLO`` (the
    shared ``conflux_cluster.slo.token_deadlines_met``, exact: ``eps=0``). A request with no
    output token (aborted before its first) meets neither.
    """
    return token_deadlines_met(arrival, token_times, slo.ttft_s, slo.tbt_s)


# ================================================================================ recording
@dataclass(frozen=True)
class IterationSample:
    """What one XP iteration did, for ``InstanceMetrics.record_iteration``. Lists are per rank."""

    measured_s: float  # wall time of the iteration (plan → all ranks' results back)
    prefill_tokens: Sequence[int]  # [N] prefill tokens each rank processed this step
    decode_tokens: Sequence[int]  # [N] decode tokens (resident decodes) each rank ran
    estimated_s: float | None = None  # estimator's T_iter for this plan, if computed
    control_plane_s: float | None = None  # plan send + result gather time (not compute)
    decode_context_tokens: Sequence[int] | None = None  # [N] Σ c_i of resident decodes per rank
    kv_cache_usage: Sequence[float] | None = None  # [N] fraction of each rank's KV blocks used
    preempted: int = 0  # requests the plan preempted (KV exhausted on their rank)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_hits: int = 0  # of those, tokens the cache served
    step_scale: float | None = None  # the scheduler's step-budget calibration (policy slo), if any
    admission_accuracy: float | None = None  # share of admission's recent predictions that came true (slo), if known
    admission_fallback: bool | None = None  # prefills ordered FCFS because those predictions go wrong (slo)
    estimator_refits: int | None = None  # online refits of the estimator profile so far (refit_every), if any

    @classmethod
    def from_plan(cls, plan, num_ranks: int, measured_s: float, estimated_s: float | None = None,
                  control_plane_s: float | None = None, **extra) -> "IterationSample":
        """Per-rank token counts from a ``conflux_cluster.engine.contracts.step.StepPlan``.

        prefill_tokens[r] = Σ (end - start) over the plan's PrefillSlices on rank r;
        decode_tokens[r]  = len(plan.decode[r]) (one token per resident decode).
        """
        prefill = [0] * num_ranks
        for sl in plan.prefill:
            prefill[sl.rank] += sl.end - sl.start
        decode = [len(plan.decode[r]) if r < len(plan.decode) else 0 for r in range(num_ranks)]
        return cls(measured_s=measured_s, prefill_tokens=prefill, decode_tokens=decode,
                   estimated_s=estimated_s, control_plane_s=control_plane_s,
                   preempted=len(plan.preempted), prefix_queries=plan.prefix_queries,
                   prefix_hits=sum(h.num_tokens for h in plan.prefix_hits), **extra)


def sample_from_engine(core, measured_s: float,
                       control_plane_s: float | None = None) -> IterationSample | None:
    """``IterationSample`` of an ``EngineCore``'s latest step (None before the first plan).

    Reads ``core.last_plan`` / ``core.last_decode_context``; ``estimated_s`` is the scheduler's
    latency estimator on that plan when the scheduler uses the estimator (policy ``slo``);
    per-rank KV use is the scheduler's block accounting (``core.scheduler.kv.utilization``).
    """
    plan = getattr(core, "last_plan", None)
    if plan is None:
        return None
    n = core.config.num_ranks
    ctx = list(getattr(core, "last_decode_context", None) or [0] * n)
    sched = core.scheduler
    estimated = scale = refits = None
    if sched.config.uses_estimator():
        estimated = sched.plan_estimate(plan, ctx)
        scale = sched.step_scale
        refits = sched.refit.refits if getattr(sched, "refit", None) is not None else None
    outcomes = sched.outcomes.stats() if sched.outcomes is not None else None
    kv = sched.kv  # the scheduler's per-rank KV block accounting (reserved blocks)
    kv_use = [min(1.0, max(0.0, kv.utilization(r))) for r in range(n)]
    return IterationSample.from_plan(plan, n, measured_s, estimated, control_plane_s,
                                     decode_context_tokens=ctx, kv_cache_usage=kv_use, step_scale=scale,
                                     estimator_refits=refits,
                                     admission_accuracy=outcomes.accuracy if outcomes is not None else None,
                                     admission_fallback=outcomes.fallback if outcomes is not None else None)


@dataclass
class _RequestTimeline:
    arrival: float
    num_prompt_tokens: int
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    last_event: float | None = None  # time of the previous token delta
    scheduled: float | None = None  # when its first prefill chunk was scheduled (ends the queue time)


class InstanceMetrics:
    """Metrics of one XP instance (construct one per instance, inside its replica/actor).

    Keeps the timelines of in-flight requests (removed when they finish) to derive TTFT, ITL,
    TPOT, E2E and SLO attainment. Call the request-timeline methods (``on_*``) from one thread
    (the instance's event loop); ``record_iteration`` / ``record_load`` / ``record_queue`` touch
    only the gauges' last values (under a lock) and may run on the engine thread;
    ``refresh_gauges`` (every ``GAUGE_REFRESH_S``) keeps an idle instance's gauges exported.
    All timestamps come from ``clock`` (default ``time.monotonic``); pass ``now=`` / ``arrival=``
    only with values from the same clock.
    """

    def __init__(self, model_name: str, instance_id: str, num_ranks: int,
                 slo: SLO | None = None,
                 clock: Callable[[], float] = time.monotonic, engine: str = "0") -> None:
        if num_ranks < 1:
            raise ValueError(f"InstanceMetrics: num_ranks must be >= 1, got {num_ranks}")
        self.model_name, self.instance_id, self.num_ranks = model_name, instance_id, num_ranks
        self.slo, self._clock = slo, clock
        self._tags = {MODEL: model_name, ENGINE: engine, XP_INSTANCE: instance_id}
        self._m = _make("instance", self._tags)
        self._gauges = _Gauges(self._m)
        self._rank_tags = [{**self._tags, RANK: str(r)} for r in range(num_ranks)]
        self._requests: dict[str, _RequestTimeline] = {}

    # ---------------------------------------------------------------- iteration / instance state
    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """Prompt tokens looked up in the prefix cache and, of those, served by it (vLLM's counters)."""
        if queries:
            _inc(self._m["vllm_prefix_cache_queries"], queries)
            _inc(self._m["vllm_prefix_cache_hits"], hits)

    def record_iteration(self, sample: IterationSample) -> None:
        """Record one iteration: latency (measured, estimated, ratio), per-rank tokens."""
        self._check_ranks("prefill_tokens", sample.prefill_tokens)
        self._check_ranks("decode_tokens", sample.decode_tokens)
        m = self._m
        m["conflux_iterations"].inc(1.0)
        m["conflux_iteration_latency_seconds"].observe(float(sample.measured_s))
        _inc(m["conflux_iteration_measured_seconds"], sample.measured_s)
        if sample.estimated_s is not None and sample.estimated_s > 0:
            _inc(m["conflux_iteration_estimated_seconds"], sample.estimated_s)
            m["conflux_iteration_estimate_ratio"].observe(sample.measured_s / sample.estimated_s)
        if sample.control_plane_s is not None:
            _inc(m["conflux_control_plane_seconds"], sample.control_plane_s)
        if sample.step_scale is not None:
            self._gauges.set("conflux_step_budget_scale", sample.step_scale)
        if sample.estimator_refits is not None:
            self._gauges.set("conflux_estimator_refits", sample.estimator_refits)
        if sample.admission_accuracy is not None:
            self._gauges.set("conflux_admission_accuracy", sample.admission_accuracy)
        if sample.admission_fallback is not None:
            self._gauges.set("conflux_admission_fcfs_fallback", float(sample.admission_fallback))
        total = sum(sample.prefill_tokens) + sum(sample.decode_tokens)
        if total > 0:
            m["vllm_iteration_tokens_total"].observe(float(total))
        if sample.preempted:
            _inc(m["vllm_num_preemptions"], sample.preempted)
        self.record_prefix_cache(sample.prefix_queries, sample.prefix_hits)
        for r, tags in enumerate(self._rank_tags):
            _inc(m["conflux_rank_prefill_tokens"], sample.prefill_tokens[r], tags)
            _inc(m["conflux_rank_decode_tokens"], sample.decode_tokens[r], tags)
        if sample.decode_context_tokens is not None:
            self._check_ranks("decode_context_tokens", sample.decode_context_tokens)
            for r, tags in enumerate(self._rank_tags):
                self._gauges.set("conflux_rank_decode_context_tokens", sample.decode_context_tokens[r], tags)
        if sample.kv_cache_usage is not None:
            self._check_ranks("kv_cache_usage", sample.kv_cache_usage)
            for r, tags in enumerate(self._rank_tags):
                self._gauges.set("conflux_rank_kv_cache_usage_perc", sample.kv_cache_usage[r], tags)

    def record_queue(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Set the instance gauges: running / waiting requests and KV use (fraction 0..1)."""
        if not 0.0 <= kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be a fraction in [0, 1], got {kv_cache_usage}")
        self._gauges.set("vllm_num_requests_running", num_running)
        self._gauges.set("vllm_num_requests_waiting", num_waiting)
        self._gauges.set("vllm_kv_cache_usage_perc", kv_cache_usage)

    def record_load(self, load) -> None:
        """Set the instance gauges from a ``conflux_cluster.engine.contracts.cluster.InstanceLoad``.

        running = ``num_decoding`` (resident in decode), waiting = ``num_waiting`` (prefill not
        finished, including partly prefilled), KV use = ``kv_utilization``.
        """
        self.record_queue(load.num_decoding, load.num_waiting,
                          min(1.0, max(0.0, float(load.kv_utilization))))

    # ------------------------------------------------------------------------ request timeline
    def on_request_arrival(self, request_id: str, num_prompt_tokens: int,
                           arrival: float | None = None) -> None:
        """A request was admitted to this instance (counts its prompt tokens)."""
        if request_id in self._requests:
            raise ValueError(f"InstanceMetrics: duplicate request id {request_id!r}")
        t = self._clock() if arrival is None else arrival
        self._requests[request_id] = _RequestTimeline(t, int(num_prompt_tokens))
        if num_prompt_tokens > 0:
            self._m["vllm_prompt_tokens"].inc(float(num_prompt_tokens))

    def on_tokens(self, request_id: str, num_new_tokens: int, now: float | None = None,
                  scheduled_at: float | None = None) -> None:
        """``num_new_tokens`` output tokens of a request were emitted at ``now``; ``scheduled_at``: when
        its first prefill chunk was scheduled (the engine's ``StepOutput.scheduled_at``), if known.

        The first call records TTFT; later calls record one inter-token latency each (the gap
        since the previous delta, like vLLM). Unknown ids (already finished) are ignored.
        """
        tl = self._requests.get(request_id)
        if tl is None or num_new_tokens <= 0:
            return
        if tl.scheduled is None and scheduled_at is not None:
            tl.scheduled = scheduled_at
        t = self._clock() if now is None else now
        if tl.last_event is None:
            self._m["vllm_time_to_first_token_seconds"].observe(max(0.0, t - tl.arrival))
        else:
            self._m["vllm_inter_token_latency_seconds"].observe(max(0.0, t - tl.last_event))
        tl.last_event = t
        tl.token_times.extend([t] * num_new_tokens)
        self._m["vllm_generation_tokens"].inc(float(num_new_tokens))

    def on_request_finished(self, request_id: str, finished_reason: str,
                            now: float | None = None) -> SLOJudgement | None:
        """A request ended (``"stop"``, ``"length"``, ``"abort"``...). Returns its SLO verdict.

        Records E2E, TPOT, prompt/output length histograms, the success counter, vLLM's phase times
        (queue: arrival -> scheduled, prefill: scheduled -> first token, decode: first -> last token,
        inference: scheduled -> last token; for requests with a token and a known scheduling time)
        and, when the instance has SLO targets, the SLO counters. Aborted requests (``"abort"``: the client
        went away) are not judged against the SLOs. Unknown ids return None.
        """
        tl = self._requests.pop(request_id, None)
        if tl is None:
            return None
        t = self._clock() if now is None else now
        m = self._m
        m["vllm_request_success"].inc(1.0, {**self._tags, FINISHED_REASON: finished_reason})
        m["vllm_e2e_request_latency_seconds"].observe(max(0.0, t - tl.arrival))
        n_out = len(tl.token_times)
        if n_out > 1:
            tpot = (tl.token_times[-1] - tl.token_times[0]) / (n_out - 1)
            m["vllm_request_time_per_output_token_seconds"].observe(max(0.0, tpot))
        if tl.num_prompt_tokens > 0:
            m["vllm_request_prompt_tokens"].observe(float(tl.num_prompt_tokens))
        if n_out > 0:
            m["vllm_request_generation_tokens"].observe(float(n_out))
        if n_out > 0 and tl.scheduled is not None:
            first, last = tl.token_times[0], tl.token_times[-1]
            for name, seconds in (("queue", tl.scheduled - tl.arrival), ("prefill", first - tl.scheduled),
                                  ("decode", last - first), ("inference", last - tl.scheduled)):
                m[f"vllm_request_{name}_time_seconds"].observe(max(0.0, seconds))
        if self.slo is None or finished_reason == ABORT:
            return None
        verdict = judge_slo(tl.arrival, tl.token_times, self.slo)
        m["conflux_slo_requests"].inc(1.0)
        for name, ok in (("conflux_slo_ttft_met", verdict.ttft_met),
                         ("conflux_slo_tbt_met", verdict.tbt_met),
                         ("conflux_slo_met", verdict.met)):
            if ok:
                m[name].inc(1.0)
        return verdict

    def refresh_gauges(self) -> int:
        """Set every gauge again to its last value (call every ``GAUGE_REFRESH_S``; see there)."""
        return self._gauges.refresh()

    @property
    def num_tracked_requests(self) -> int:
        """Requests arrived and not yet finished (a leak check for callers' tests)."""
        return len(self._requests)

    def _check_ranks(self, what: str, values: Sequence) -> None:
        if len(values) != self.num_ranks:
            raise ValueError(f"IterationSample.{what} has {len(values)} entries, "
                             f"expected one per rank ({self.num_ranks})")


class RouterMetrics:
    """Metrics of one global-router replica: decisions per instance, decision time, loads."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._m = _make("router", {ROUTER_POLICY: policy})

    def record_decision(self, instance_id: str, decision_s: float) -> None:
        """The router sent one request to ``instance_id`` after ``decision_s`` seconds of work."""
        self._m["conflux_router_decisions"].inc(1.0, {XP_INSTANCE: instance_id})
        self._m["conflux_router_decision_seconds"].observe(max(0.0, float(decision_s)))

    def record_loads(self, normalized_loads: Mapping[str, float]) -> None:
        """The normalized queued workload the router currently sees, per instance id (set on every load
        report, at least once a second: no refresh needed, see ``GAUGE_REFRESH_S``)."""
        for inst, load in normalized_loads.items():
            self._m["conflux_router_instance_load"].set(float(load), {XP_INSTANCE: inst})


class IngressMetrics:
    """Metrics of the OpenAI HTTP ingress: requests rejected before reaching an instance."""

    def __init__(self, model_name: str) -> None:
        self._m = _make("ingress", {MODEL: model_name})

    def record_error(self, status_code: int) -> None:
        """One request answered with an error status (400, 401, 404, 413, 500, ...)."""
        self._m["conflux_request_errors"].inc(1.0, {CODE: str(int(status_code))})

    def record_priority(self, priority: int) -> None:
        """One request accepted with this ``priority`` (counted under its bucket: at most 23 labels)."""
        self._m["conflux_requests_by_priority"].inc(1.0, {PRIORITY: priority_bucket(priority)})
