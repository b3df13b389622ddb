"""Step times as a served engine ran them: measured / modelled ratios replayed in the simulator.

The simulator times a step at its cost model's estimate. A served engine's steps scatter around
that (host time, clocks, kernel variance; on one H200 a median 1.00–1.09× by step family with a few
per cent of spread), and a request whose first token comes just in time then misses a later
per-token deadline, which an exact simulator never shows. ``StepNoise`` holds the ratios of served
steps (``conflux serve --step-log``) to the profile the simulator times with, by step family
(decode-only, prefill-only, mixed), and each simulated step of an engine-scheduler system draws
one from its family (seeded: a run is reproducible). ConfluxServe's step calibration then sees the
drawn times, as the engine sees its measured ones::

    noise = StepNoise.from_step_logs(["steps-conflux.0.jsonl"], profile)
    setting = replace(setting, step_noise=noise)      # conflux_cluster.sim.registry.Setting
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from conflux_cluster.engine.scheduler.estimator import BatchLoad, EstimatorProfile, LatencyEstimator
from conflux_cluster.engine.scheduler.fitting.step_log import family, read_step_log

FAMILIES = ("decode", "prefill", "hetero")


@dataclass(frozen=True)
class StepNoise:
    """Measured / modelled step-time ratios per step family; ``seed`` seeds each instance's draws."""

    ratios: dict[str, tuple[float, ...]]
    seed: int = 0

    def __post_init__(self) -> None:
        if not any(self.ratios.get(f) for f in FAMILIES):
            raise ValueError("StepNoise needs at least one measured / modelled step ratio")
        bad = [r for f in FAMILIES for r in self.ratios.get(f, ()) if not r > 0]
        if bad:
            raise ValueError(f"StepNoise ratios must be > 0, got {bad[:3]}")

    @classmethod
    def from_step_logs(cls, paths: Sequence[str], profile: EstimatorProfile, seed: int = 0) -> "StepNoise":
        """Ratios of the logged steps' measured seconds to ``profile``'s estimate of each."""
        est = LatencyEstimator(profile)
        out: dict[str, list[float]] = {f: [] for f in FAMILIES}
        for path in paths:
            for s in read_step_log(path):
                modelled = est.estimate(s.load).total
                if modelled > 0:
                    out[family(s.load)].append(s.seconds / modelled)
        return cls({f: tuple(v) for f, v in out.items()}, seed)

    def sampler(self) -> Callable[[BatchLoad], float]:
        """A draw function for one instance: a ratio from the step's family (every family pooled where
        the logs held none of it)."""
        rng = random.Random(self.seed)
        pooled = tuple(r for f in FAMILIES for r in self.ratios.get(f, ()))
        pools = {f: self.ratios.get(f) or pooled for f in FAMILIES}

        def draw(load: BatchLoad) -> float:
            pool = pools[family(load)]
            return pool[rng.randrange(len(pool))]

        return draw

    def median(self, fam: str) -> float | None:
        values = sorted(self.ratios.get(fam, ()))
        return values[len(values) // 2] if values else None
