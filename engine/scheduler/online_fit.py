"""The latency estimator refitted on the instance's own served steps, while it serves (beyond the paper).

The paper fits its estimator once, on profiled batches. Served steps differ from profiled ones in
ways the profile does not see (one H200, Llama-3.1-8B, 2026-12-04: decode-only steps took 1.04-1.09×
the shipped profile's estimate, mixed steps 0.95×), so the shipped profile's error on served steps
was 6-8 % and the step calibration (one scale for every prefill-carrying step) cannot remove an error
that differs by step family. Replayed on those logs (benchmarks/online_refit_replay.py), refitting
every 64 steps on the profiler's samples plus the latest 512 served ones estimated each later step
within 3.9 % (MAPE, steps 256 onwards) where the shipped profile was off by 8.8 % and 5.5 %.

    observe(load, seconds)      every executed step (the scheduler's ``observe_step``)
    poll() -> profile | None    a refit that is done and estimates the window's steps better than the
                                profile in use (which it then becomes), else None; starts the next
                                refit once ``every`` new steps arrived

Each fit starts from the given profile and includes the profiler's samples, which keep it sensible
for shapes the window lacks (a fit on 100 served steps alone, all from one phase of a run, was off by
22 % on the next ones). Judging a fit on held-out halves or on the newest steps only refused good
refits as often as bad ones (replayed: 5.3 % and 8.6 % instead of 3.9 %), so the check is in-sample:
it refuses a fit that does not beat the profile in use on the very steps it saw (e.g. an exact one).

The fit (``profiler.refine_jointly``: bounded least squares on relative error, scipy) runs on one
background thread (``background``; the engine's scheduling loop does not wait for it: 10-150 ms on
one core) or inline (the tests, the replay benchmark; the simulator does not refit). Without scipy nothing is refitted.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence

from .estimator import BatchLoad, EstimatorProfile
from .fit import BatchSample, profile_mape


class OnlineRefit:
    """Refits ``profile`` on ``base`` (the profiler's samples, may be empty) plus the latest ``window``
    served steps, every ``every`` steps; see the module docstring."""

    def __init__(self, profile: EstimatorProfile, base: Sequence[BatchSample] = (), every: int = 64,
                 window: int = 512, background: bool = True) -> None:
        if every < 1 or window < 2 * every:
            raise ValueError(f"online refit needs every >= 1 and window >= 2 x every, got {every}, {window}")
        self.start = profile  # every fit starts from the profile the instance was given
        self.current = profile
        self.base = list(base)
        self.every, self.background = every, background
        self.steps: deque[BatchSample] = deque(maxlen=window)
        self.refits = 0  # refits accepted
        self.rejected = 0  # refits that did not beat the profile in use
        self.last_mape: tuple[float, float] | None = None  # (in use, refit) on the latest refit's window
        self._new = 0  # steps observed since the latest refit started
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def observe(self, load: BatchLoad, seconds: float) -> None:
        if seconds > 0:
            self.steps.append(BatchSample(load, seconds))
            self._new += 1

    def poll(self) -> EstimatorProfile | None:
        """A better profile when a refit finished and beat the one in use (then it is the one in use)."""
        better = None
        if self._pending is not None and self._pending.done():
            better = self._accept(self._pending.result())
            self._pending = None
        if self._pending is None and self._new >= self.every and len(self.steps) >= 2 * self.every:
            self._new = 0
            window = list(self.steps)
            if self.background:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="estimator-refit")
                self._pending = self._pool.submit(self._fit, window)
            else:
                better = self._accept(self._fit(window)) or better
        return better

    def _fit(self, window: list[BatchSample]) -> tuple[EstimatorProfile | None, list[BatchSample]]:
        from ..profiler import refine_jointly  # scipy; None without it

        return refine_jointly(self.start, self.base + window), window  # judged on the window it fitted

    def _accept(self, fitted: tuple[EstimatorProfile | None, list[BatchSample]]) -> EstimatorProfile | None:
        profile, held = fitted
        if profile is None or not held:
            return None
        now, new = profile_mape(self.current, held), profile_mape(profile, held)
        self.last_mape = (now, new)
        if new >= now:
            self.rejected += 1
            return None
        meta = dict(profile.meta, online_refit={"steps": len(held), "mape_percent": new, "previous_mape_percent": now})
        self.current = replace(profile, meta=meta)
        self.refits += 1
        return self.current

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
