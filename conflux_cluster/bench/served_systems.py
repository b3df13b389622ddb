"""The systems ``benchmarks/gpu_goodput.py`` serves for real, and the simulator's model of each.

Every system is this engine behind ``conflux serve``, differing only in flags:

    name                xp_mode      policy  budget                          simulator kind
    conflux             xp           slo     waterfill under the TBT SLO     conflux (engine Scheduler + estimator)
    chunked-sp / ++     uniform-sp   fcfs / srpt  fixed max_num_batched_tokens   chunked-sp
    chunked-tp / ++     uniform-tp   fcfs / srpt  fixed                          chunked-tp
    no-cobatch / ++     no-cobatch   fcfs / srpt  fixed                          no-cobatch
    conflux-pc          xp           slo     as conflux, ``--enable-prefix-caching``      conflux-pc
    router-<policy>     xp           slo     as conflux, ``--instances 2 --ranks 1 --router-policy <policy>``

"++" is the paper's SRPT order (shortest remaining prefill first). Baselines run with the
estimator profile 'budget' (a fixed budget needs no fitted profile, so no start-up profiling).
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def is_baseline(self) -> bool:
        return self.policy != "slo"

    def num_ranks(self, default: int) -> int:
        return self.ranks or default

    def gpus(self, default_ranks: int) -> int:
        """Devices the system uses (goodput per GPU divides by this)."""
        return self.instances * self.num_ranks(default_ranks)

    def server_args(self) -> list[str]:
        """``conflux serve`` flags (``--ranks`` is the spec's; these come after it)."""
        args = ["--xp-mode", self.xp_mode, "--policy", self.policy]
        if self.is_baseline:
            args += ["--estimator-profile", "budget"]
        if self.instances > 1:
            args += ["--instances", str(self.instances)]
        if self.router_policy:
            args += ["--router-policy", self.router_policy]
        if self.prefix_cache:
            args.append("--enable-prefix-caching")
        return args

    def sim_config(self, limits: EngineLimits) -> SystemConfig:
        """The simulator's model of this system, with the engine's own fixed budget for the baselines."""
        knobs = (("budget", limits.max_num_batched_tokens),) if self.is_baseline else ()
        if self.prefix_cache:
            knobs += (("prefix_cache", True),)
        return SystemConfig(self.name, SIM_KIND[self.xp_mode], self.policy, knobs)


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
    bad = [n for n in wanted if n not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown systems {bad}; known: {', '.join(SYSTEMS)} (or default, router, all)")
    return [SYSTEMS[n] for n in dict.fromkeys(wanted)]
