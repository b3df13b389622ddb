"""``MultiprocExecutor``: one XP instance as N x k local worker processes (torch.multiprocessing).

    parent (engine core)                        worker w = r * k + t   (logical rank r, TP index t)
      execute(StepInput) ──pipe────────────────> RankWorker.execute (XP attention) -> StepResult
      merge sampled tokens  <──pipe────────────
    rendezvous: TCPStore hosted by the parent on a port the OS picks; gloo (CPU) or NCCL (GPU)

``submit`` sends a step and returns (``overlaps``): the engine plans the next step while the workers
run this one; each worker answers its pipe's calls in order, so results are gathered in order. A GPU
worker launches a step and, while its device runs it, waits for the next call: if that comes first it
is launched before the earlier step's tokens are read (``RankWorker.launch`` / ``finish``).
Errors in a worker come back as ``WorkerError`` with the worker's traceback; a worker that dies
without answering is detected; ``shutdown()`` stops every worker (also on garbage collection).
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import tempfile
import traceback
from dataclasses import dataclass
from typing import Literal

import torch
import torch.multiprocessing as mp

from ..contracts.step import StepInput, StepResult, step_device_s
from ..prompt_logprobs import merge_prompt_logprobs
from ..config import EngineConfig, xp_topology
from ..loader import ModelSource, load_model, resolve_model
from ..xp.phases import iterations
from ..contracts.step import Rendezvous
from ..xp.launch import host_store, join_group, leave_group
from ..xp.modes import XPMode
from ..xp.spec import XPInstanceSpec, export_weights
from .build import build_rank_worker


class WorkerError(RuntimeError):
    """A worker process failed; carries its rank and traceback."""


@dataclass(frozen=True)
class _Call:
    """Parent -> worker process, one per request; the worker answers ``("ok", value)`` or ``("err", traceback)``."""

    kind: Literal["step", "set_mode", "kv_free", "stop"]
    payload: StepInput | XPMode | None = None  # step: one iteration's input; set_mode: the mode


class _SentStep:
    """A step sent to every worker; ``result()`` gathers and merges their answers."""

    def __init__(self, executor: MultiprocExecutor, step: int, iterations: int) -> None:
        self._executor, self._step, self._iterations = executor, step, iterations

    def result(self) -> StepResult:
        iterations = [self._executor._gather() for _ in range(self._iterations)]
        results = [res for it in iterations for res in it]
        sampled: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        top: dict = {}
        for res in results:  # TP ranks of one logical rank report the same tokens
            sampled.update(res.sampled)
            logprobs.update(res.logprobs)
            top.update(res.top_logprobs)
        return StepResult(self._step, sampled, logprobs, top_logprobs=top,
                          prompt_logprobs=merge_prompt_logprobs([r.prompt_logprobs for r in results]),
                          device_s=step_device_s(iterations))


def _worker_main(spec: XPInstanceSpec, rdv: Rendezvous, world_rank: int, conn) -> None:
    try:
        torch.set_num_threads(spec.config.num_threads or 1)
        join_group(rdv, world_rank)
        worker = build_rank_worker(spec, world_rank)
        conn.send(("ok", worker.kv.num_blocks))  # the handshake carries the pool size
    except BaseException:  # noqa: BLE001 - report everything to the parent
        conn.send(("err", traceback.format_exc()))
        return
    ahead = None  # the step launched last, its reply not sent yet
    while True:
        try:
            if ahead is not None and not _next_call_before(conn, worker, ahead):
                conn.send(("ok", worker.finish(ahead)))  # the device finished it before the next call came
                ahead = None
            call: _Call = conn.recv()
            if call.kind == "step":  # launch it, then answer the step before it (its device work ran meanwhile)
                launched = worker.launch(call.payload)
                if ahead is not None:
                    conn.send(("ok", worker.finish(ahead)))
                ahead = launched
                continue
            if ahead is not None:
                conn.send(("ok", worker.finish(ahead)))
                ahead = None
            if call.kind == "stop":
                break
            if call.kind == "set_mode":
                if worker.requests or worker.attention.kv.prefill or worker.attention.kv.decode:
                    raise RuntimeError("set_mode needs an idle instance (no request in flight)")
                worker.attention.set_mode(call.payload)
                conn.send(("ok", None))
            elif call.kind == "kv_free":
                kv = worker.attention.kv
                worker.check_invariants()
                # cached prefix blocks stay (the scheduler evicts them); nothing else may be held
                conn.send(("ok", kv.num_free_blocks + len(kv.cache) == kv.num_blocks and not kv.prefill
                           and not kv.decode))
            else:
                raise ValueError(f"unknown call {call.kind!r}")
        except BaseException:  # noqa: BLE001
            conn.send(("err", traceback.format_exc()))
            break
    leave_group(ok=False)  # no barrier: peers may already have stopped


def _next_call_before(conn, worker, launched, poll_s: float = 5e-4) -> bool:
    """Wait until the parent's next call is queued (True) or ``launched``'s device work is done (False):
    a worker that launches step k+1 before it reads step k's tokens keeps its device busy while it
    prepares the next step (``RankWorker.launch``). On a CPU ``launch`` has done the work already: the
    reply goes at once (running the next step first would only hold this one's tokens back)."""
    if launched.done is None:
        return False
    while not conn.poll(poll_s):
        if worker.is_done(launched):
            return conn.poll()
    return True


class MultiprocExecutor:
    """Runs an XP instance: ``config.num_ranks`` logical ranks x ``config.tp_size`` devices.

    Non-preset weights are loaded once here and mmapped by the workers (``weights_dir`` or a
    temporary directory removed at shutdown).
    """

    def __init__(self, config: EngineConfig, source: ModelSource | None = None, timeout_s: float = 600.0,
                 weights_dir: str | None = None) -> None:
        config = xp_topology(config)
        source = source or resolve_model(config.model)
        self.config, self.timeout_s = config, timeout_s
        self.mode = XPMode(config.xp_mode)
        self._tmp = None
        weights = None
        if source.kind != "preset":  # dequantize / read once, not N x k times
            if weights_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="xp-weights-")
                weights_dir = self._tmp.name
            weights = os.path.join(weights_dir, "weights.pt")
            if not os.path.exists(weights):  # an existing file is reused (same model and dtype!)
                model = load_model(source, config.torch_dtype(), "cpu", progress=False, seed=config.seed)
                export_weights(model, weights)
                del model
        spec = XPInstanceSpec(config, source, weights)
        backend = config.device.collective_backend
        self._store, rdv = host_store(spec.world_size, backend)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for w in range(spec.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(spec, rdv, w, child), daemon=True,
                            name=f"xp-worker-{w}")
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._closed = False
        try:
            blocks = self._gather()
        except BaseException:
            self.shutdown()
            raise
        if len(set(blocks)) != 1:  # build_rank_worker agrees on the minimum; anything else is a bug
            self.shutdown(force=True)
            raise WorkerError(f"workers allocated different KV pools: {blocks} blocks")
        self.blocks_per_rank: int = blocks[0]

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

    def _call(self, kind: Literal["set_mode", "kv_free"], payload: XPMode | None = None) -> list[object]:
        if self._closed:
            raise RuntimeError("executor is shut down")
        for c in self._conns:
            c.send(_Call(kind, payload))
        return self._gather()

    overlaps = True

    @property
    def launches_ahead(self) -> bool:
        """The workers launch each step before they answer the one before it; on CUDA that launch returns
        before the device ran it (on a CPU the step runs inside it)."""
        return self.config.on_cuda

    def execute(self, step_input: StepInput) -> StepResult:
        return self.submit(step_input).result()

    def submit(self, step_input: StepInput) -> "_SentStep":
        its = iterations(step_input, self.mode)
        if self._closed:
            raise RuntimeError("executor is shut down")
        for it in its:
            for c in self._conns:
                c.send(_Call("step", it))
        return _SentStep(self, step_input.plan.step, len(its))

    def check_invariants(self) -> None:
        """Raise unless every worker's KV pool invariants hold (see ``XPKVCache.check_invariants``)."""
        self._call("kv_free")

    def kv_free(self) -> list[bool]:
        """Per worker: is its KV pool entirely free (no block held, no table)?"""
        return self._call("kv_free")

    def set_mode(self, mode: XPMode | str) -> None:
        """Switch every worker to ``mode`` (same topology; only while no request is in flight)."""
        mode = XPMode(mode)
        if (mode == XPMode.UNIFORM_TP) != (self.mode == XPMode.UNIFORM_TP):
            raise ValueError("uniform-tp changes the device topology: start a new instance")
        self._call("set_mode", mode)
        self.mode = mode

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
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "MultiprocExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
