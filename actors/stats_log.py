"""A throughput line in the replica log every few seconds while an instance works (vLLM's "Avg
generation throughput" line), with where the time went::

    XP instance 0: 1,041 output tok/s, 64 running, 0 waiting, KV 38.1 %; 412 steps of 15.2 ms,
    ranks busy 95.3 % (control plane 2.1 % of step wall); prefill steps at 1.04x their estimate

``ranks busy`` is the slowest rank's compute time over the interval's wall time: below 100 % the
device waited for the scheduler, the control plane or the event loop between steps. The last part
(only when it is not 1) is the scheduler's calibration of its step budget (``calibrate_steps``); with
the prefix cache, the share of the prompt tokens of prefills started in the interval that it served
("; prefix cache hit rate 41.3 %", as vLLM's line has it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from conflux_cluster.engine.contracts.cluster import InstanceLoad

log = logging.getLogger("ray.serve")  # the replica's configured logger: lands in its log at INFO


@dataclass(frozen=True)
class Totals:
    """Cumulative counters the line is the difference of."""

    output_tokens: int = 0
    iterations: int = 0
    step_s: float = 0.0  # engine-thread time inside EngineCore.step
    rank_compute_s: float = 0.0  # slowest rank's compute
    control_s: float = 0.0
    rank_wall_s: float = 0.0  # the control plane's step wall time
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (0 without one)
    prefix_hits: int = 0  # of those, served from it


class StatsLine:
    """Call ``tick()`` every interval; it logs a line when anything happened since the last one."""

    def __init__(self, index: int, totals: Callable[[], Totals], load: Callable[[], InstanceLoad],
                 step_scale: Callable[[], float] = lambda: 1.0) -> None:
        self.index, self._totals, self._load, self._scale = index, totals, load, step_scale
        self._last, self._at = totals(), time.monotonic()

    def tick(self) -> str | None:
        now, cur = time.monotonic(), self._totals()
        prev, wall = self._last, max(now - self._at, 1e-9)
        self._last, self._at = cur, now
        steps = cur.iterations - prev.iterations
        if steps <= 0:
            return None
        line = format_line(self.index, wall, steps, cur, prev, self._load(), self._scale())
        log.info("%s", line)
        return line


def format_line(index: int, wall: float, steps: int, cur: Totals, prev: Totals, load: InstanceLoad,
                step_scale: float = 1.0) -> str:
    tok_s = (cur.output_tokens - prev.output_tokens) / wall
    step_ms = 1e3 * (cur.step_s - prev.step_s) / steps
    busy = (cur.rank_compute_s - prev.rank_compute_s) / wall
    rank_wall = cur.rank_wall_s - prev.rank_wall_s
    control = (cur.control_s - prev.control_s) / rank_wall if rank_wall > 0 else 0.0
    return (f"XP instance {index}: {tok_s:,.0f} output tok/s, {load.num_decoding} running, {load.num_waiting} "
            f"waiting, KV {100 * load.kv_utilization:.1f} %; {steps} steps of {step_ms:.1f} ms, ranks busy "
            f"{100 * busy:.1f} % (control plane {100 * control:.1f} % of step wall)"
            + (f"; prefill steps at {step_scale:.2f}x their estimate" if step_scale != 1.0 else "")
            + _prefix_part(cur, prev))


def _prefix_part(cur: Totals, prev: Totals) -> str:
    """vLLM's prefix cache hit rate over the interval, where prefills started in it."""
    queries = cur.prefix_queries - prev.prefix_queries
    return f"; prefix cache hit rate {100 * (cur.prefix_hits - prev.prefix_hits) / queries:.1f} %" if queries else ""
