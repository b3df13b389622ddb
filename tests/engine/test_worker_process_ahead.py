"""A worker process's wait between launching a step and answering the one before
(engine/runtime/multiproc.py, ``_next_call_before``): on a CPU it answers at once; on a GPU it runs the
next call first when that arrives while the device still computes, and answers as soon as the device
is done otherwise. The device is stood in for by an event whose ``query()`` the test sets (a CUDA
event does not run here); the pipe is a real one."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

from conflux_cluster.engine.runtime.multiproc import _next_call_before
from conflux_cluster.engine.runtime.worker import RankWorker


class _Event:
    def __init__(self, done_after_s: float) -> None:
        self._at = time.monotonic() + done_after_s

    def query(self) -> bool:
        return time.monotonic() >= self._at


def _launched(done):
    return SimpleNamespace(result=None, done=done)


def test_cpu_step_answers_at_once():
    parent, child = mp.Pipe()
    parent.send("next step")  # even with a call queued: a CPU launch already did the work
    assert _next_call_before(child, RankWorker, _launched(None)) is False


def test_gpu_step_runs_the_next_call_first_when_it_comes_in_time():
    parent, child = mp.Pipe()
    parent.send("next step")
    assert _next_call_before(child, RankWorker, _launched(_Event(10.0))) is True


def test_gpu_step_answers_when_the_device_is_done_and_no_call_came():
    _, child = mp.Pipe()
    t0 = time.monotonic()
    assert _next_call_before(child, RankWorker, _launched(_Event(0.05))) is False
    assert 0.04 <= time.monotonic() - t0 < 2.0
