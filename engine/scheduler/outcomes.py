"""Admission judged against outcomes: Moore–Hodgson's predictions, checked when the first token comes.

Each admission pass gives every waiting request a verdict: *meets* (it is in the admitted set) or *misses*
(given up: served after the admitted ones); the one that counts is the latest before its first token, i.e.
the verdict of the pass that planned its final prompt chunk. (Its first verdict would be judged on what
happened after it: later arrivals and deferred requests that went first, by design, not by error; on the
simulated H200 that alone read as ~50 % "wrong" under overload.) When its first token is produced the
scheduler tells this tracker the time; the prediction was right when "met its TTFT
deadline" equals what it said. Over the latest ``window`` resolved predictions the share that were
right is the admission's accuracy. Below ``threshold`` the policy falls back to FCFS order (nothing is
dropped, every request keeps its place in arrival order) until the accuracy is back above
``threshold + HYSTERESIS``: a latency estimator that drifted, or bursts the surrogate does not see, then
cost what FCFS would, not more.

    predict(req, meets)      at every admission pass while ``req`` waits (not after a preemption)
    resolve(rid, now)        its first token was produced at ``now``
    forget(rid)              it ended before its first token (abort)
    accuracy / fallback      what the policy and the metrics read
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .requests import SchedRequest

HYSTERESIS = 0.05  # the accuracy must climb this far above the threshold before EDF order comes back


@dataclass(frozen=True)
class OutcomeStats:
    """What the tracker has seen (exported as metrics and in /v1/conflux/stats)."""

    predictions: int  # resolved predictions so far
    correct: int  # of those, right
    accuracy: float | None  # share right over the latest window (None: fewer than min_samples resolved)
    fallback: bool  # the policy orders in FCFS now
    fallbacks: int  # times it switched to FCFS so far


class AdmissionOutcomes:
    """Rolling accuracy of admission's meets / misses predictions, and the FCFS fallback it drives."""

    def __init__(self, window: int = 64, threshold: float = 0.8, min_samples: int = 32) -> None:
        if not 0 < min_samples <= window:
            raise ValueError(f"min_samples={min_samples} must be in [1, window={window}]")
        self.threshold = threshold
        self.min_samples = min_samples
        self._pending: dict[str, tuple[bool, float]] = {}  # request id -> (predicted meets, TTFT deadline)
        self._recent: deque[bool] = deque(maxlen=window)  # right or wrong, newest last
        self._right = 0  # right predictions in _recent
        self.predictions = 0
        self.correct = 0
        self.fallback = False
        self.fallbacks = 0

    def predict(self, req: SchedRequest, meets: bool) -> None:
        """Record admission's latest verdict on ``req`` (a recompute after a preemption is not judged)."""
        if req.num_preemptions:
            return
        self._pending[req.request_id] = (meets, req.ttft_deadline)

    def predicted(self, request_id: str) -> bool | None:
        """The verdict that would be judged now (None: none)."""
        entry = self._pending.get(request_id)
        return None if entry is None else entry[0]

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def resolve(self, request_id: str, now: float) -> None:
        """``request_id``'s first token was produced at ``now``: score its prediction, update the fallback."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        meets, deadline = entry
        right = meets == (now <= deadline + 1e-9)
        if len(self._recent) == self._recent.maxlen:
            self._right -= self._recent[0]
        self._recent.append(right)
        self._right += right
        self.predictions += 1
        self.correct += right
        self._update_fallback()

    @property
    def accuracy(self) -> float | None:
        if len(self._recent) < self.min_samples:
            return None
        return self._right / len(self._recent)

    def _update_fallback(self) -> None:
        acc = self.accuracy
        if acc is None:
            return
        if not self.fallback and acc < self.threshold:
            self.fallback = True
            self.fallbacks += 1
        elif self.fallback and acc >= self.threshold + HYSTERESIS:
            self.fallback = False

    def stats(self) -> OutcomeStats:
        return OutcomeStats(self.predictions, self.correct, self.accuracy, self.fallback, self.fallbacks)
