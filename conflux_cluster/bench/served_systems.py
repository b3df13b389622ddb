"""The systems ``benchmarks/gpu_goodput.py`` serves for real, and the simulator's model of each.

Every system is this engine behind ``conflux serve``, differing only in flags:

    name                xp_mode      policy  budget                          simulator kind
    conflux             xp           slo     waterfill under the TBT SLO     conflux (engine Scheduler + estimator)
    chunked-sp / ++     uniform-sp   fcfs / srpt  fixed max_num_batched_tokens   chunked-sp (one device: conflux)
    chunked-tp / ++     uniform-tp   fcfs / srpt  fixed                          chunked-tp (one device: conflux)
    no-cobatch / ++     no-cobatch   fcfs / srpt  fixed                          no-cobatch
    conflux-pc          xp           slo     as conflux, ``--enable-prefix-caching``      conflux-pc
    router-<policy>     xp           slo     as conflux, ``--instances 2 --ranks 1 --router-policy <policy>``

Every system but conflux-pc runs with the prefix cache off (``--no-enable-prefix-caching``; the
engine's default is on), as the paper's systems do. "++" is the paper's SRPT order (shortest remaining prefill first). Baselines run with the
estimator profile 'budget' (a fixed budget needs no fitted profile, so no start-up profiling).
A baseline's token budget is the engine's default (2048 per rank on GPUs) unless its name asks for
one: ``chunked-sp++@512`` runs with ``--max-num-batched-tokens 512``. The paper sweeps that budget
per model, workload and TBT target and reports the best (§8 "Baselines"): name several, e.g.
``--systems conflux,chunked-sp++@512,chunked-sp++@1024,chunked-sp++``; the ratio is over the best.
On ONE device (one rank, TP 1) uniform SP and uniform TP compute exactly what XP computes, so the
baselines run there with ``--xp-mode xp`` (``served_mode``): the same kernels, with decode attention
in its captured CUDA graphs. Their uniform-sp path attends decodes eagerly inside the SP region, and
on one H200 its decode-only steps took 1.9x conflux's (docs/results/LOG.md): a handicap with no
counterpart in a real uniform-SP system. A baseline still differs in its order and fixed budget, and
the simulator times it there as it was served: the engine's estimator under the baseline's scheduler
(``sim_config``; its uniform-SP model would serialise the two attention paths that the one-device XP
engine runs as one step).
ConfluxServe may name a step stretch: ``conflux@x4`` runs with ``--max-step-stretch 4`` (a step's prefill
may take up to 4 × the TBT SLO while every decode keeps slack to its per-token deadlines).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conflux_cluster.sim.limits import EngineLimits
from conflux_cluster.sim.registry import SystemConfig

SIM_KIND = {"xp": "conflux", "uniform-sp": "chunked-sp", "uniform-tp": "chunked-tp", "no-cobatch": "no-cobatch"}
ROUTER_POLICIES = ("lowest_load", "round_robin", "power_of_two")


@dataclass(frozen=True)
class ServedSystem:
    """One served configuration."""

    name: str
    xp_mode: str  # EngineConfig.xp_mode
    policy: str  # SchedulerConfig.policy: slo | fcfs | srpt
    instances: int = 1  # XP instances behind the router
    ranks: int | None = None  # ranks per instance (None: the benchmark's --ranks)
    router_policy: str | None = None
    prefix_cache: bool = False  # --enable-prefix-caching (the trace's hash_ids make the reuse real)
    budget: int | None = None  # --max-num-batched-tokens of a baseline (None: the engine's default)
    stretch: float | None = None  # --max-step-stretch of ConfluxServe (None: the engine's default, 1)

    @property
    def is_baseline(self) -> bool:
        return self.policy != "slo"

    def num_ranks(self, default: int) -> int:
        return self.ranks or default

    def gpus(self, default_ranks: int) -> int:
        """Devices the system uses (goodput per GPU divides by this)."""
        return self.instances * self.num_ranks(default_ranks)

    def served_mode(self, ranks: int | None) -> str:
        """The ``--xp-mode`` served on ``ranks`` ranks of one device each (module docstring: one device
        runs the uniform baselines as ``xp``)."""
        if self.num_ranks(ranks or 0) == 1 and self.xp_mode in ("uniform-sp", "uniform-tp"):
            return "xp"
        return self.xp_mode

    def server_args(self, ranks: int | None = None) -> list[str]:
        """``conflux serve`` flags on ``ranks`` ranks per instance (None: not known; ``--ranks`` is the
        spec's and comes before these)."""
        args = ["--xp-mode", self.served_mode(ranks), "--policy", self.policy]
        if self.is_baseline:
            args += ["--estimator-profile", "budget"]
        if self.instances > 1:
            args += ["--instances", str(self.instances)]
        if self.router_policy:
            args += ["--router-policy", self.router_policy]
        args.append("--enable-prefix-caching" if self.prefix_cache else "--no-enable-prefix-caching")  # on by default
        if self.budget is not None:
            args += ["--max-num-batched-tokens", str(self.budget)]
        if self.stretch is not None:
            args += ["--max-step-stretch", f"{self.stretch:g}"]
        return args

    @property
    def file_name(self) -> str:
        """The name as a file name that comes back from the GPU machine ('+' -> 'p', '@' -> '-b')."""
        return self.name.replace("+", "p").replace("@", "-b")

    def sim_config(self, limits: EngineLimits, ranks: int | None = None) -> SystemConfig:
        """The simulator's model of this system as served on ``ranks`` ranks (its ``served_mode``: on one
        device the uniform baselines are the XP engine under their own order and budget, and are timed as
        such), with the engine's own fixed budget for the baselines."""
        knobs = (("budget", self.budget or limits.max_num_batched_tokens),) if self.is_baseline else ()
        if self.prefix_cache:
            knobs += (("prefix_cache", True),)
        if self.stretch is not None:
            knobs += (("stretch", self.stretch),)
        return SystemConfig(self.name, SIM_KIND[self.served_mode(ranks)], self.policy, knobs)


def _catalogue() -> dict[str, ServedSystem]:
    out = {"conflux": ServedSystem("conflux", "xp", "slo"),
           "conflux-pc": ServedSystem("conflux-pc", "xp", "slo", prefix_cache=True)}
    for base, mode in (("chunked-sp", "uniform-sp"), ("chunked-tp", "uniform-tp"), ("no-cobatch", "no-cobatch")):
        out[base] = ServedSystem(base, mode, "fcfs")
        out[base + "++"] = ServedSystem(base + "++", mode, "srpt")
    for p in ROUTER_POLICIES:
        out[f"router-{p}"] = ServedSystem(f"router-{p}", "xp", "slo", instances=2, ranks=1, router_policy=p)
    return out


SYSTEMS = _catalogue()
DEFAULT_SYSTEMS = ("conflux", "chunked-sp", "chunked-sp++", "chunked-tp", "chunked-tp++", "no-cobatch", "no-cobatch++")
ROUTER_SYSTEMS = tuple(f"router-{p}" for p in ROUTER_POLICIES)


def pick(names: str) -> list[ServedSystem]:
    """Comma list of names, or 'default' / 'router' / 'all'."""
    groups = {"default": DEFAULT_SYSTEMS, "router": ROUTER_SYSTEMS, "all": DEFAULT_SYSTEMS + ROUTER_SYSTEMS}
    wanted = [n for part in names.split(",") if part.strip() for n in groups.get(part.strip(), (part.strip(),))]
    out = [_system(n) for n in dict.fromkeys(wanted)]
    bad = [n for n, s in zip(dict.fromkeys(wanted), out) if s is None]
    if bad:
        raise ValueError(f"unknown systems {bad}; known: {', '.join(SYSTEMS)}, a baseline@TOKENS (its token budget, "
                         "e.g. chunked-sp++@512), conflux@xF (its step stretch, e.g. conflux@x4), or default, "
                         "router, all")
    return out


def _system(name: str) -> ServedSystem | None:
    """A catalogue system, a baseline with its token budget (``chunked-sp++@512``) or ConfluxServe with
    its step stretch (``conflux@x4``)."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    base, sep, knob = name.partition("@")
    if not sep or base not in SYSTEMS:
        return None
    if SYSTEMS[base].is_baseline:
        return replace(SYSTEMS[base], name=name, budget=int(knob)) if knob.isdigit() and int(knob) >= 1 else None
    try:
        stretch = float(knob[1:]) if knob.startswith("x") else 0.0
    except ValueError:
        return None
    return replace(SYSTEMS[base], name=name, stretch=stretch) if 1.0 <= stretch <= 16.0 else None
