"""``MultiprocExecutor``: one XP instance as N x k local worker processes (torch.multiprocessing).

    parent (engine core)                        worker w = r * k + t   (logical rank r, TP index t)
      execute(XPStepInput) ──pipe──────────────> XPRunner.execute -> StepResult (t == 0 reports)
      merge sampled tokens  <──pipe────────────
    rendezvous: TCPStore hosted by the parent on a port the OS picks; gloo (CPU) or NCCL (GPU)

Errors in a worker come back as ``WorkerError`` with the worker's traceback; a worker that dies
without answering is detected; ``shutdown()`` stops every worker (also on garbage collection).
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from ..plan import StepResult
from .launch import Rendezvous, host_store, join_group
from .meta import XPMode
from .runner import XPStepInput
from .spec import XPInstanceSpec, build_runner


class WorkerError(RuntimeError):
    """A worker process failed; carries its rank and traceback."""


@dataclass(frozen=True)
class _Call:
    kind: str  # "step" | "kv_free" | "stop"
    payload: object = None


def _worker_main(spec: XPInstanceSpec, rdv: Rendezvous, world_rank: int, conn) -> None:
    try:
        torch.set_num_threads(spec.threads_per_worker)
        join_group(rdv, world_rank)
        runner = build_runner(spec, world_rank)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        call: _Call = conn.recv()
        if call.kind == "stop":
            break
        try:
            if call.kind == "step":
                conn.send(("ok", runner.execute(call.payload)))
            elif call.kind == "set_mode":
                runner.set_mode(call.payload)
                conn.send(("ok", None))
            elif call.kind == "kv_free":
                conn.send(("ok", runner.kv_is_free()))
            else:
                raise ValueError(f"unknown call {call.kind!r}")
        except BaseException:  # noqa: BLE001
            conn.send(("err", traceback.format_exc()))
            break
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


class MultiprocExecutor:
    """Runs an XP instance of ``spec.num_ranks`` logical ranks x ``spec.tp_size`` devices."""

    def __init__(self, spec: XPInstanceSpec, timeout_s: float = 600.0) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.mode = spec.mode
        world = spec.world_size
        backend = "nccl" if spec.device == "cuda" else "gloo"
        self._store, rdv = host_store(world, backend)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for w in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(spec, rdv, w, child), daemon=True,
                            name=f"xp-worker-{w}")
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._closed = False
        try:
            self._gather()
        except BaseException:
            self.shutdown()
            raise

    def _gather(self) -> list[object]:
        """Wait for one answer from every worker; raise on an error or a dead worker."""
        answers: dict[int, object] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            ready = mpc.wait(list(pending.values()), timeout=self.timeout_s)
            if not ready:
                dead = [w for w in pending if not self._procs[w].is_alive()]
                raise WorkerError(f"workers {dead or list(pending)} did not answer within {self.timeout_s}s")
            for w, c in list(pending.items()):
                if c not in ready:
                    continue
                try:
                    status, value = c.recv()
                except EOFError:
                    self._fail(f"worker {w} exited (code {self._procs[w].exitcode}) without answering")
                if status == "err":
                    self._fail(f"worker {w} failed:\n{value}")
                answers[w] = value
                del pending[w]
        return [answers[w] for w in range(len(self._conns))]

    def _fail(self, message: str) -> None:
        self.shutdown(force=True)
        raise WorkerError(message)

    def _call(self, kind: str, payload: object = None) -> list[object]:
        if self._closed:
            raise RuntimeError("executor is shut down")
        for c in self._conns:
            c.send(_Call(kind, payload))
        return self._gather()

    def execute(self, step_input: XPStepInput) -> StepResult:
        sampled: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        for res in self._call("step", step_input):
            sampled.update(res.sampled)
            logprobs.update(res.logprobs)
        return StepResult(step_input.plan.step, sampled, logprobs)

    def kv_free(self) -> list[bool]:
        """Per worker: is its KV pool entirely free (no block held, no table)?"""
        return self._call("kv_free")

    def set_mode(self, mode: XPMode | str) -> None:
        """Switch every worker to ``mode`` (same topology; only while no request is in flight)."""
        self._call("set_mode", XPMode(mode))
        self.mode = XPMode(mode)

    def shutdown(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            if not force:
                try:
                    c.send(_Call("stop"))
                except (BrokenPipeError, OSError):
                    pass
        for p in self._procs:
            p.join(timeout=0.1 if force else 30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._store = None

    def __enter__(self) -> "MultiprocExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
