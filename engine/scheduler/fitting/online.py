"""The latency estimator refitted on the instance's own served steps, while it serves (beyond the paper).

The paper fits its estimator once, on profiled batches. Served steps differ from profiled ones in
ways the profile does not see (one H200, Llama-3.1-8B: decode-only steps took 1.04-1.09×
the profiler-only profile's estimate, mixed steps 0.95×), so that profile's error on served steps
was 6-8 % and the step calibration (one scale for every prefill-carrying step) cannot remove an error
that differs by step family. Replayed on those logs (benchmarks/step_logs/refit.py), refitting
every 64 steps on the profiler's samples plus the latest 512 served ones estimated each later step
within 3.9 % (MAPE, steps 256 onwards) where the profile alone was off by 8.8 % and 5.5 %.

    observe(load, seconds)      every executed step (the scheduler's ``observe_step``)
    poll() -> profile | None    a refit that is done and estimates the window's steps better than the
                                profile in use (which it then becomes), else None; starts the next
                                refit once ``every`` new steps arrived

Each fit starts from the given profile and includes the profiler's samples, which keep it sensible
for shapes the window lacks (a fit on 100 served steps alone, all from one phase of a run, was off by
22 % on the next ones). Judging a fit on held-out halves or on the newest steps only refused good
refits as often as bad ones (replayed: 5.3 % and 8.6 % instead of 3.9 %), so the check is in-sample:
it refuses a fit that does not beat the profile in use on the very steps it saw (e.g. an exact one).

The fit (``samples.refine_jointly``: bounded least squares on relative error, scipy) runs in one
background process (``background``; the engine's scheduling loop does not wait for it: 10-150 ms on
one core). In a thread of the serving process it held the GIL the scheduling loop needs: in two of
four served logs, decode-only steps of one shape then varied by 6.6-7.2 % (weighted CV; worst group
16-92 %); 1.0-2.1 % without a refit, 1.8 % (worst 3.1 %) with it in a process (one H200).
Inline (``background=False``): the tests and the replay benchmark; the simulator does
not refit. Without scipy, or where no process can be started, nothing is refitted and the profile in
use stays.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from ..estimator import BatchLoad, EstimatorProfile
from .fit import BatchSample, profile_mape
from .samples import Measurements, refine_jointly  # refine_jointly: scipy, None without it

log = logging.getLogger(__name__)

Fitted = tuple[EstimatorProfile | None, float, float]  # (refit or None, MAPE of the profile in use, of the refit)


def raw_samples_path(profile_path: str | Path) -> Path:
    """Where the profiler's samples of the profile at ``profile_path`` lie: ``raw-<its name>`` beside it
    (shipped beside the H200 profiles; ``profile_store.auto_profile`` writes it)."""
    p = Path(profile_path)
    return p.with_name("raw-" + p.name)


def profiler_samples(profile_path: str | Path) -> list[BatchSample]:
    """The profiler's samples beside the profile at ``profile_path`` (every family), or [] where there are
    none; OSError / ValueError (naming the file) for one that cannot be read."""
    raw = raw_samples_path(profile_path)
    if not raw.is_file():
        return []
    m = Measurements.from_json(raw)
    return m.decode + m.prefill + m.hetero


def refit_window(start: EstimatorProfile, current: EstimatorProfile, samples: list[BatchSample],
                 window: list[BatchSample]) -> Fitted:
    """Fit from ``start`` on ``samples`` (the profiler's + the window); both profiles' MAPE on ``window``.
    Module-level: it runs in the refit process."""
    fitted = refine_jointly(start, samples)
    if fitted is None or not window:
        return None, 0.0, 0.0
    return fitted, profile_mape(current, window), profile_mape(fitted, window)


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
        self.broken = False  # closed, or the refit process failed: no more refits (the profile in use stays)
        self._new = 0  # steps observed since the latest refit started
        self._pool: ProcessPoolExecutor | None = None
        self._pending: Future | None = None

    def observe(self, load: BatchLoad, seconds: float) -> None:
        if seconds > 0:
            self.steps.append(BatchSample(load, seconds))
            self._new += 1

    def forget_steps(self) -> None:
        """Drop the steps observed so far (a warm-up's, which pay first-use costs) and a refit fitted on them."""
        self.steps.clear()
        self._new = 0
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def poll(self) -> EstimatorProfile | None:
        """A better profile when a refit finished and beat the one in use (then it is the one in use)."""
        better = None
        if self._pending is not None and self._pending.done():
            try:
                better = self._accept(self._pending.result())
            except Exception as e:  # noqa: BLE001 - a failed refit leaves the profile in use
                self._give_up(e)
            self._pending = None
        if self.broken or self._pending is not None or self._new < self.every or len(self.steps) < 2 * self.every:
            return better
        self._new = 0
        window = list(self.steps)
        args = (self.start, self.current, self.base + window, window)
        if not self.background:
            return self._accept(refit_window(*args)) or better
        try:
            if self._pool is None:  # a process: the fit's Python would hold the scheduler's GIL for 10-150 ms
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            self._pending = self._pool.submit(refit_window, *args)
        except Exception as e:  # noqa: BLE001 - no process here: serve on with the profile in use
            self._give_up(e)
        return better

    def _give_up(self, e: Exception) -> None:
        log.warning("online estimator refit off (%s: %s); the profile in use stays", type(e).__name__, e)
        self.broken = True
        self.close()

    def _accept(self, fitted: Fitted) -> EstimatorProfile | None:
        profile, now, new = fitted
        if profile is None:
            return None
        if new >= now:
            self.rejected += 1
            return None
        meta = dict(profile.meta, online_refit={"steps": len(self.steps), "mape_percent": new,
                                                "previous_mape_percent": now})
        self.current = replace(profile, meta=meta)
        self.refits += 1
        return self.current

    def close(self) -> None:
        """Stop the refit process; no refit starts after this (the profile in use stays)."""
        self.broken = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
