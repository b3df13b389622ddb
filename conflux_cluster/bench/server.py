"""``conflux serve`` as a measured subprocess, and the client side of one such server.

Shared by the HTTP benchmarks (``benchmarks/gpu_serve.py``, ``benchmarks/gpu_goodput.py``):

    ServerSpec      what to start: model, device, ranks, API key, further ``conflux serve`` flags
    ServerProcess   the child process (its own session; OS-chosen port read from its "is up" line;
                    ready once /v1/models answers); ``stop()`` also stops what it started (Ray)
    ServedModel     the served model's card (name, context) and the token-accurate client
                    (``conflux_cluster.bench.client``) with the benchmark's SLOs
    wait_gpus_free  after a server stopped: wait until no other process holds GPU memory
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from conflux_cluster.engine.config import Device

from .client import ClientConfig, RequestResult, run_workload
from .report import summarize, vllm_result
from .workload import BenchRequest

_UP = re.compile(r"ConfluxServe is up: (http://\S+?)/v1")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class ServerSpec:
    """One ``conflux serve`` command line (``extra`` flags come last: argparse lets them override)."""

    model: str
    device: Device  # cpu or cuda
    ranks: int  # logical ranks per instance
    api_key: str  # the server requires it: auth is on the measured path
    extra: tuple[str, ...] = ()  # further conflux serve flags, verbatim

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "conflux_cluster.commands.serve", "--model", self.model, "--device",
                str(self.device), "--ranks", str(self.ranks), "--port", "0", "--api-key", self.api_key, *self.extra]


class ServerProcess:
    """``conflux serve`` as a child process (its own session, so stopping it stops what it started)."""

    def __init__(self, spec: ServerSpec, tag: str, out_dir: Path) -> None:
        self.spec = spec
        self.cmd = spec.argv()
        self.log_path = Path(out_dir) / f"serve-{tag}.log"
        self.base_url: str | None = None
        self.proc: subprocess.Popen | None = None
        self._up = threading.Event()

    def start(self, timeout_s: float) -> str:
        log(f"starting: {' '.join(self.cmd[1:])}  (log: {self.log_path})")
        t0 = time.time()
        # cwd outside the repository: its conflux_cluster/ folder must not shadow the installed package
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=tempfile.gettempdir(), start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._pump, daemon=True).start()
        while not self._up.wait(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"conflux serve exited with {self.proc.returncode}; last lines:\n{self.tail()}")
            if time.time() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"conflux serve not up after {timeout_s:.0f}s; last lines:\n{self.tail()}")
        self._wait_models(t0 + timeout_s)
        log(f"server ready at {self.base_url} after {time.time() - t0:.1f}s")
        return self.base_url

    def _pump(self) -> None:
        with open(self.log_path, "w") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                m = _UP.search(line)
                if m and not self._up.is_set():
                    self.base_url = m.group(1)
                    self._up.set()

    def _wait_models(self, deadline: float) -> None:
        headers = {"Authorization": f"Bearer {self.spec.api_key}"}
        while True:
            try:
                if httpx.get(f"{self.base_url}/v1/models", headers=headers, timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{self.base_url}/v1/models did not answer")
            time.sleep(0.5)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 90.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        log("stopping the server")
        self.proc.send_signal(signal.SIGTERM)  # conflux serve: serve.shutdown(), ray.shutdown()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log("server did not stop in time: killing its process group")
        try:  # whatever it started and left behind (Ray's daemons share its session)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


@dataclass(frozen=True)
class ClientSettings:
    """How the benchmark talks to a server and judges its requests."""

    api_key: str
    vocab: int  # synthetic prompt ids are drawn below this
    seed: int = 0
    request_timeout_s: float = 900.0
    ttft_slo: float = 1.0  # s
    tbt_slo: float = 0.1  # s


DEADLINE_GRACE_S = 2.0  # the last token's deadline plus this: its chunk has reached the client


class ServedModel:
    """Client side of one server: its model card, the token-accurate client, the SLO summary."""

    def __init__(self, base_url: str, settings: ClientSettings) -> None:
        self.base_url, self.settings = base_url, settings
        card = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {settings.api_key}"},
                         timeout=30).json()["data"][0]
        self.model, self.max_model_len = card["id"], card.get("max_model_len")

    def client(self, deadline_s: float | None = None, decide_by_slo: bool = False) -> ClientConfig:
        s = self.settings
        return ClientConfig(self.base_url, self.model, s.api_key, s.vocab, s.seed, timeout_s=s.request_timeout_s,
                            deadline_s=deadline_s,
                            decided_slo=(s.ttft_slo, s.tbt_slo) if decide_by_slo else None)

    def run(self, requests: list[BenchRequest], prompts: list[list[int]] | None = None,
            deadline_s: float | None = None, decide_by_slo: bool = False) -> tuple[list[RequestResult], float]:
        """``decide_by_slo``: end once every request still running is certain to miss the SLO."""
        return asyncio.run(run_workload(self.client(deadline_s, decide_by_slo), requests, prompts))

    def instance_stats(self) -> list[dict]:
        """Each XP instance's control-plane counters (``/v1/conflux/stats``; [] where the server has none)."""
        try:
            r = httpx.get(f"{self.base_url}/v1/conflux/stats", timeout=30,
                          headers={"Authorization": f"Bearer {self.settings.api_key}"})
            return list(r.json().get("instances", [])) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return []

    def slo_deadline(self, requests: list[BenchRequest], drain_s: float | None) -> float:
        """When a rate point ends at the latest (s after its start): ``drain_s`` after the last arrival,
        or (None) once the last request's last token is past its deadline, whatever it was: then every
        request's attainment is decided, and one that had not finished is a miss."""
        last = requests[-1].arrival_s
        if drain_s is not None:
            return last + drain_s
        s = self.settings
        return last + s.ttft_slo + max(r.output_len - 1 for r in requests) * s.tbt_slo + DEADLINE_GRACE_S

    def summary(self, results: list[RequestResult], duration: float, arrays: bool = False) -> dict:
        """``BenchReport`` fields plus ``vllm bench serve``'s flat keys (per-request arrays with ``arrays``)."""
        rep = summarize(results, duration, self.settings.ttft_slo, self.settings.tbt_slo)
        flat = vllm_result(rep, results)
        if not arrays:
            flat = {k: v for k, v in flat.items() if not isinstance(v, list)}
        return {**rep.to_dict(), **flat}


def go_higher(attainment: float, settle_s: float, stop_below: float, what: str) -> bool:
    """Between the rates of a sweep: pause (aborted leftovers free their KV), and whether to go on to
    the next rate (not after a rate below ``stop_below`` attainment)."""
    time.sleep(settle_s)
    if attainment < stop_below:
        log(f"{what}: below {100 * stop_below:.0f}% attainment: higher rates skipped")
        return False
    return True


@contextlib.contextmanager
def measuring(server: ServerProcess, device: Device, res: dict, what: str):
    """Run the block against ``server``: an exception ends the block but not the benchmark (recorded
    in ``res["error"]``: what was measured stays); the server is always stopped, its GPUs freed."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - keep what was measured; say what failed
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"{what} failed: {res['error']}")
    finally:
        server.stop()
        wait_gpus_free(device)


def wait_gpus_free(device: Device, timeout_s: float = 120.0) -> None:
    """After a server or the offline engine stopped: wait until no other process holds GPU memory
    (the next phase sizes its KV pool from what is free)."""
    if not device.has_gpus or shutil.which("nvidia-smi") is None:
        return
    t0, others = time.time(), []
    while time.time() - t0 < timeout_s:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        others = [line for line in out.splitlines() if line.strip() and int(line.split(",")[0]) != os.getpid()]
        if not others:
            return
        time.sleep(2)
    log(f"warning: after {timeout_s:.0f}s other processes still hold GPU memory (pid, MiB): {others}")


def hardware(device: Device) -> str:
    """What ran the benchmark, in words (GPU count and name, or the CPU's cores)."""
    if device.has_gpus and shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True).stdout.strip().splitlines()
        return f"{len(q)} x {q[0]}" if q else "cuda"
    return f"cpu ({os.cpu_count()} cores)"


def git_commit(repo: Path) -> str | None:
    """The commit the results come from: ``CONFLUX_GIT_COMMIT`` when set (a copy of the tree whose ``.git``
    lags behind it, as on the GPU machine), else HEAD, with ``+dirty`` when tracked files differ from it."""
    named = os.environ.get("CONFLUX_GIT_COMMIT", "").strip()
    if named:
        return named
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        if not head:
            return None
        changed = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        return head + ("+dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now_iso() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


# ---- what the HTTP benchmark scripts share on their command line and in their JSON --------------------


def add_server_arguments(p, out_name: str) -> None:
    """The flags every HTTP benchmark script has: which server to start and where results go."""
    p.add_argument("--model", default=None, help="default: llama-3.1-8b (--quick: tiny-llama)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--ranks", type=int, default=None, help="ranks per instance (default: the visible GPUs; CPU: 2)")
    p.add_argument("--server-arg", action="append", default=[], help="passed to conflux serve (repeatable)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, help=f"JSON results (default: $OUT/{out_name}, else ./{out_name})")


def resolve_device(device: str) -> Device:
    """``--device`` as a ``Device``; ``auto``: cuda when torch sees a GPU, else cpu."""
    if Device(device) is not Device.AUTO:
        return Device(device)
    import torch

    return Device.CUDA if torch.cuda.is_available() else Device.CPU


def quick_defaults(args, argv: list[str] | None, defaults: tuple[tuple[str, str, object], ...]) -> None:
    """For ``--quick``: set each ``(flag, attribute, value)`` whose flag the command line did not give."""
    given = set(argv if argv is not None else sys.argv[1:])
    for flag, attr, val in defaults:
        if not any(g == flag or g.startswith(flag + "=") for g in given):
            setattr(args, attr, val)


def default_ranks(device: Device) -> int:
    """Ranks per instance when not given: the visible GPUs on CUDA, 2 on CPU."""
    if not device.has_gpus:
        return 2
    import torch

    return max(1, torch.cuda.device_count())


def finish_args(args, name: str):
    """The last step of parsing: a fresh API key for the server the benchmark starts (auth is on the
    measured path), and ``args.out``: ``--out``, else ``$OUT/<name>`` (the device machine's result
    folder), else ``./<name>``; its folder is created."""
    import secrets

    args.api_key = "sk-" + secrets.token_hex(8)
    out_dir = os.environ.get("OUT")
    args.out = Path(args.out or (Path(out_dir) / name if out_dir else name))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return args


def run_record(args, argv: list[str] | None, repo: Path, skip: tuple[str, ...] = ("api_key",)) -> dict:
    """The head of a result JSON: date, hardware, command, commit, arguments (without ``skip``); a path inside
    ``repo`` is written relative to it (a result names files anyone's checkout has, not this machine's)."""
    return {"date": now_iso(), "hardware": hardware(args.device),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "git_commit": git_commit(repo),
            "args": {k: in_repo(v, repo) for k, v in vars(args).items() if k not in skip}}


def in_repo(value: object, repo: Path) -> object:
    """``value`` (a Path or path string, or a list of them) relative to ``repo`` where it lies inside it; a Path
    as a string."""
    if isinstance(value, (list, tuple)):
        return [in_repo(v, repo) for v in value]
    if not isinstance(value, (str, Path)):
        return value
    root = str(repo.resolve()).rstrip("/") + "/"
    text = str(value)
    return text[len(root):] if text.startswith(root) else text
