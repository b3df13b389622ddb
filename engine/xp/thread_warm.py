"""Per-thread warm-up: work whose result a library caches per thread, redone once in each thread that runs steps.

torch keeps cuDNN's attention execution plans in a thread-local cache (ATen's ``MHAGraphCache``: cuDNN
plans are not guaranteed thread-safe). A rank builds its split-history plans while it is set up, in
one thread, but under Ray the steps run in another (the compiled graph's execution loop), so every
plan was built again at its first use there: served steps over long histories took 40-55 ms more
each time a chunk met a new (query tiles, partitions) shape, e.g. whenever a history crossed a
multiple of 16,384 keys (one H200 step logs: 30 of 851 steps, each > 1.25x both
neighbours). ``PerThreadWarm.ensure`` at the start of a step redoes the warm-up once per thread; the
engine's warm-up steps (engine/runtime/warmup.py) run on the same thread as served ones, before ready.
"""

from __future__ import annotations

import threading
from typing import Callable


class PerThreadWarm:
    """Runs ``warm`` once in each thread that calls ``ensure`` (``warmed_here``: the constructing thread
    already holds what ``warm`` builds). A thread-local flag, not thread ids: an ended thread's id is
    reused by the next one, whose cache starts empty."""

    def __init__(self, warm: Callable[[], object], warmed_here: bool = True) -> None:
        self._warm = warm
        self._local = threading.local()
        self._local.warm = warmed_here
        self.threads = int(warmed_here)  # how many threads were warm (statistics)

    def ensure(self) -> bool:
        """Warm this thread if it is new; returns whether it did."""
        if getattr(self._local, "warm", False):
            return False
        self._warm()  # raises: this thread stays cold and tries again at its next call
        self._local.warm = True
        self.threads += 1
        return True
