"""Goodput of every system in one setting on one workload, and the Fig. 12-style plot.

For each system the configurations of ``registry.sweep`` are searched and the best is kept (the
paper's protocol: every baseline at its best configuration). To keep a full run short, an FCFS
baseline is evaluated at the configuration that was best for its "++" counterpart when that was
already searched (``reuse_plus_knobs``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from .goodput import GoodputResult, goodput
from .registry import Setting, SystemConfig, sweep
from .workloads import Workload


@dataclass
class SystemResult:
    system: str
    best: str  # label of the best configuration
    goodput: float  # req/s
    tried: dict[str, float] = field(default_factory=dict)  # label -> goodput of each configuration
    curve: list[tuple[float, float, bool]] = field(default_factory=list)  # (rate, attainment, stopped early)
    at_goodput: dict | None = None  # TTFT/TBT/E2E percentiles at the goodput rate


def start_rate(s: Setting, workload: Workload) -> float:
    """A first guess for the search: 30% of the instance's linear-layer prefill throughput."""
    c = s.costs()
    per_token = c.gemm.slope + c.gemm.intercept / 2048  # amortised over a 2K-token step (fitted slopes can be ≈0)
    tokens_per_s = s.num_ranks / (s.model.num_layers * per_token)
    mean_prompt = sum(r.prompt_len for r in workload.requests) / len(workload)
    return max(0.1, 0.3 * tokens_per_s / mean_prompt)


def evaluate(s: Setting, workload: Workload, systems: list[str], quick: bool = False,
             reuse_plus_knobs: bool = True, rel_tol: float = 0.04, progress: bool = True) -> dict[str, SystemResult]:
    """Goodput search for every configuration of every system; returns the best per system."""
    plan: list[tuple[str, list[SystemConfig]]] = [(name, sweep(name, s, quick)) for name in systems]
    order = sorted(plan, key=lambda p: not p[0].endswith("++"))  # "++" first, so FCFS can reuse knobs
    total = sum(len(c) for _, c in plan)
    bar = tqdm(total=total, desc=f"{s.model.name} {workload.name}", disable=not progress, leave=False)
    start = start_rate(s, workload)
    out: dict[str, SystemResult] = {}
    for name, configs in order:
        plus = out.get(name + "++")
        if reuse_plus_knobs and plus is not None and len(configs) > 1:
            bar.update(len(configs) - 1)
            knobs = next(c.knobs for c in sweep(name + "++", s, quick) if c.label == plus.best)
            configs = [SystemConfig(name, configs[0].kind if not knobs else _kind(plus.best, s, quick),
                                    "fcfs", knobs)]
        results: list[GoodputResult] = []
        for cfg in configs:
            bar.set_postfix_str(cfg.label)
            results.append(goodput(cfg.build(s), workload, s.slo, start, cfg.label, rel_tol=rel_tol))
            bar.update(1)
        best = max(results, key=lambda r: r.goodput)
        summ = best.at_goodput()
        out[name] = SystemResult(name, best.label, best.goodput, {r.label: r.goodput for r in results},
                                 [(p.rate, p.attainment, p.stopped_early) for p in best.curve()],
                                 asdict(summ) if summ else None)
    bar.close()
    return {name: out[name] for name in systems}


def _kind(label: str, s: Setting, quick: bool) -> str:
    name = label.split("[")[0]
    return next(c.kind for c in sweep(name, s, quick) if c.label == label)


def ratio_table(results: dict[str, SystemResult]) -> dict[str, float | None]:
    """ConfluxServe ÷ strongest baseline, per scheduling setting."""
    def best_of(names):
        vals = [results[n].goodput for n in names if n in results]
        return max(vals) if vals else None

    out = {}
    for ours, group in (("conflux-fcfs", ("chunked", "distserve", "loongserve", "muxwise")),
                        ("conflux", ("chunked++", "distserve++", "loongserve++", "muxwise++"))):
        b = best_of(group)
        if ours in results and b:
            out[ours] = results[ours].goodput / b
    return out


def format_table(results: dict[str, SystemResult]) -> str:
    lines = [f"{'system':14s} {'goodput':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TBT p99':>8s}  best configuration"]
    for r in results.values():
        a = r.at_goodput or {}
        ttft, tbt = a.get("ttft", {}), a.get("tbt", {})
        lines.append(f"{r.system:14s} {r.goodput:8.2f} {ttft.get('p50', math.nan):9.3f} {ttft.get('p99', math.nan):9.3f} "
                     f"{tbt.get('p99', math.nan):8.4f}  {r.best}")
    for ours, x in ratio_table(results).items():
        lines.append(f"{ours} / strongest {'FCFS' if ours.endswith('fcfs') else '++'} baseline: {x:.2f}x")
    return "\n".join(lines)


def plot(results: dict[str, SystemResult], title: str, path: str | Path) -> None:
    """Attainment vs rate per system, FCFS (left) and "++" (right); vertical lines at goodput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, plus in zip(axes, (False, True)):
        for i, r in enumerate(v for v in results.values() if (v.system.endswith("++") or v.system == "conflux") == plus):
            pts = sorted(r.curve)
            color = f"C{i}"
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", color=color, label=r.system, ms=3)
            ax.scatter([p[0] for p in pts if p[2]], [100 * p[1] for p in pts if p[2]], facecolors="none",
                       edgecolors=color, s=30)
            if r.goodput:
                ax.axvline(r.goodput, color=color, ls=":", lw=1)
        ax.axhline(95, color="grey", lw=0.8)
        ax.set_xlabel("rate (req/s)")
        ax.set_title("enhanced scheduling (++)" if plus else "FCFS")
        ax.set_ylim(0, 102)
        if ax.get_lines()[:-1]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("SLO attainment (%)")
    fig.suptitle(title + "   (hollow: run stopped once < 95% was certain; value is a lower bound)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_json(results: dict[str, SystemResult]) -> dict:
    return {"systems": {k: asdict(v) for k, v in results.items()}, "ratios": ratio_table(results)}


def save_json(obj: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(obj, indent=1))


def evaluate_rates(s: Setting, workload: Workload, systems: list[str], rates: list[float], quick: bool = False,
                   progress: bool = True) -> dict[str, SystemResult]:
    """Full runs (no early stop) at fixed rates; per system the configuration with the best mean
    attainment; its goodput is the highest listed rate that passes (0 when none)."""
    from .goodput import TARGET, run_at_rate

    out: dict[str, SystemResult] = {}
    jobs = [(name, cfg) for name in systems for cfg in sweep(name, s, quick)]
    curves: dict[str, dict[str, list]] = {}
    for name, cfg in tqdm(jobs, desc="configurations", disable=not progress, leave=False):
        pts = []
        for rate in rates:
            summ, _ = run_at_rate(cfg.build(s), workload, s.slo, rate)
            pts.append((rate, summ.attainment, False, asdict(summ)))
        curves.setdefault(name, {})[cfg.label] = pts
    for name, by_cfg in curves.items():
        label, pts = max(by_cfg.items(), key=lambda kv: sum(p[1] for p in kv[1]))
        passing = [p for p in pts if p[1] >= TARGET]
        best = max(passing, key=lambda p: p[0]) if passing else None
        out[name] = SystemResult(name, label, best[0] if best else 0.0,
                                 {k: max((p[0] for p in v if p[1] >= TARGET), default=0.0) for k, v in by_cfg.items()},
                                 [(p[0], p[1], p[2]) for p in pts], best[3] if best else None)
    return out
