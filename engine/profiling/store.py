"""Where an instance's estimator profile comes from when ``estimator_profile`` is ``'auto'``.

A profile is fitted for one (hardware, model, ranks, TP size, dtype, XP mode); its file name is
that key (``profile_key``), e.g. ``h200-llama-3.1-8b-n2.json``::

    resolve_profile(...)    1. the user cache   $CONFLUX_CACHE_DIR/profiles, else
                                                $XDG_CACHE_HOME/conflux/profiles, else ~/.cache/conflux/profiles
                            2. the shipped ones engine/scheduler/profiles/
                            -> the first file of that key that loads and matches, or None
    auto_profile(...)       runs engine/profiling/harness.py on the already-built executor with a grid sized
                            to the KV pool and a time budget (<= 60 s on a GPU), writes the cache
    resolve_estimator_profile(config, executor, hardware)
                            'auto' -> cache or shipped file; else CUDA: auto_profile once (cached
                            for the next start); CPU: 'budget' (logged). Any other value is kept.

The serving instance calls ``resolve_estimator_profile`` after its executor exists and before the
``EngineCore`` (whose scheduler reads the profile in its constructor). The profiler drives the
executor with its own ``StepPlan``s; every request it started is freed before this returns.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from ..contracts.step import StepInput, StepPlan, StepResult
from ..scheduler.estimator import EstimatorProfile
from ..scheduler.fitting.online import raw_samples_path
from ..util.user_cache import cache_root
from .harness import ENGINE_REVISION, ProfileGrid, profile_engine

if TYPE_CHECKING:
    from ..config import Device, EngineConfig
    from ..runtime.executor import Executor

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).parents[1] / "scheduler" / "profiles"
MAX_PROFILE_MAPE = 35.0  # held-out MAPE (%) above which a fitted profile is not used ('budget' instead)
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}
# memory size and memory kind do not name a different chip here; SXM is the default form factor
_DROPPED = re.compile(r"\d+gb|hbm\d*e?|sxm\d*")


def cache_dir() -> Path:
    """The user's profile cache (profiles written by ``auto_profile``; searched first)."""
    return cache_root() / "profiles"


def normalize_hardware(name: str) -> str:
    """A device name as a key: ``torch.cuda.get_device_name`` ('NVIDIA H200'), Ray's accelerator type
    ('H200') and ``conflux profile``'s ('nvidia-h200') all give 'h200'; form factors other than SXM
    stay ('NVIDIA H100 PCIe' -> 'h100-pcie'); memory sizes go ('NVIDIA A100-SXM4-80GB' -> 'a100')."""
    words = [w for w in re.split(r"[^a-z0-9.]+", name.strip().lower()) if w]
    kept = [w for w in words if w not in _VENDOR_WORDS and not _DROPPED.fullmatch(w)]
    if not kept:
        raise ValueError(f"cannot make a hardware key of {name!r}")
    return "-".join(kept)


def normalize_model(model: str) -> str:
    """A model as a key: built-in names stay; a path gives its last component without '.gguf'."""
    name = model
    if os.sep in model or model.endswith(".gguf") or Path(model).expanduser().exists():
        name = Path(model.rstrip(os.sep)).name.removesuffix(".gguf")
    key = re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-")
    if not key:
        raise ValueError(f"cannot make a model key of {model!r}")
    return key


def profile_key(model_name: str, hardware_name: str, num_ranks: int, tp_size: int = 1, dtype: str = "auto",
                xp_mode: str = "xp") -> str:
    """``<hardware>-<model>-n<N>`` plus ``-tp<k>``, ``-<dtype>``, ``-<xp_mode>`` where they are not the
    defaults (TP 1; the device's default dtype: float32 on CPU, bfloat16 on GPUs; mode 'xp')."""
    hw = normalize_hardware(hardware_name)
    key = f"{hw}-{normalize_model(model_name)}-n{num_ranks}"
    if tp_size != 1:
        key += f"-tp{tp_size}"
    default_dtype = "float32" if hw.startswith("cpu") else "bfloat16"
    if dtype not in ("auto", default_dtype):
        key += f"-{dtype}"
    if xp_mode != "xp":
        key += f"-{xp_mode}"
    return key


def resolve_profile(model_name: str, hardware_name: str, num_ranks: int, tp_size: int = 1, dtype: str = "auto",
                    *, xp_mode: str = "xp", search: Sequence[Path] | None = None) -> Path | None:
    """The first profile file of this key in ``search`` (default: the user cache, then the shipped
    profiles) that loads, was fitted for this model and number of ranks on this engine revision and
    is not a ``poor_fit``; None if there is none. The server (``resolve_estimator_profile``) and the
    benchmarks' simulator both ask here, so a start-up fit the server rejected is never used by a
    later start or by the simulator."""
    name = profile_key(model_name, hardware_name, num_ranks, tp_size, dtype, xp_mode) + ".json"
    for folder in (search if search is not None else (cache_dir(), SHIPPED_DIR)):
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            prof = EstimatorProfile.from_json(path)
        except (OSError, ValueError, TypeError) as e:
            log.warning("estimator profile %s is unreadable (%s: %s); skipped", path, type(e).__name__, e)
            continue
        if prof.num_ranks != num_ranks or normalize_model(prof.model) != normalize_model(model_name):
            log.warning("estimator profile %s was fitted for %s on %d ranks, not %s on %d; skipped",
                        path, prof.model, prof.num_ranks, model_name, num_ranks)
            continue
        if prof.meta.get("engine_revision") != ENGINE_REVISION:
            log.warning("estimator profile %s was fitted on engine revision %s, this is %d (stale); skipped",
                        path, prof.meta.get("engine_revision"), ENGINE_REVISION)
            continue
        if poor_fit(prof):  # a start-up fit that was not used stays for inspection
            log.warning("estimator profile %s fits poorly (held-out MAPE %s %% > %.0f %%); skipped",
                        path, _fmt(prof.meta.get("mape_percent_hetero_heldout")), MAX_PROFILE_MAPE)
            continue
        return path
    return None


def poor_fit(profile: EstimatorProfile) -> bool:
    """A measured profile whose held-out MAPE is missing or above ``MAX_PROFILE_MAPE``: not used
    (roofline and hand-made profiles carry no MAPE and are not judged)."""
    mape = profile.meta.get("mape_percent_hetero_heldout")
    if mape is None:
        return profile.is_measured
    return mape > MAX_PROFILE_MAPE


def local_hardware_name(device: Device) -> str:
    """This process's device as a key ('cpu', or the first visible GPU's normalized name)."""
    if not device.has_gpus:
        return "cpu"
    import torch

    return normalize_hardware(torch.cuda.get_device_name(0))


# ---- profiling at start-up ------------------------------------------------------------------------
def auto_grid(kv_tokens_per_rank: int, max_context: int, device: Device, time_budget_s: float) -> ProfileGrid:
    """A reduced ``ProfileGrid`` that fits the KV pool (decode pool and measured prompts together take
    at most ~half of it) and, on a GPU, finishes in ``time_budget_s`` (heterogeneous batches are cut
    at 80 % of it; the families before them take a few seconds on an H200)."""
    def r16(x: float) -> int:
        return max(16, int(x) // 16 * 16)

    if not device.has_gpus:
        batches, ctx_hi, chunks, pctx, hetero, setup = [1, 2, 4], 64, [8, 32, 64], [0, 64], 12, 256
    else:
        # long histories and contexts are measured, not extrapolated: a chunk's attention over a 32K
        # history costs ~4x per token pair what short-context samples fit (docs/scheduler.md)
        batches, ctx_hi, chunks, pctx, hetero, setup = [1, 8, 32], 8192, [64, 256, 1024, 4096], [0, 4096, 32768], 40, 8192
    pool = max(batches)
    room = kv_tokens_per_rank * 0.25  # for the decode pool; as much again for measured prompts
    ctx_hi = r16(min(ctx_hi, room / (pool * 0.625), max_context - 64))  # contexts hi/4 and hi: mean 0.625 hi
    prompt_room = min(kv_tokens_per_rank * 0.25, max_context - 2)
    chunks = [c for c in chunks if c <= prompt_room] or [r16(prompt_room / 2)]
    pctx = sorted({min(c, r16(prompt_room - max(chunks))) for c in pctx} | {0})
    # each heterogeneous batch twice, the fastest kept: on a GPU a first shape may still compile a kernel;
    # on a shared CPU one preempted measurement can push the held-out MAPE over MAX_PROFILE_MAPE
    return ProfileGrid(decode_batch=batches, decode_context=sorted({r16(ctx_hi / 4), ctx_hi}),
                       prefill_chunk=chunks, prefill_context=pctx, hetero_batches=hetero, repeats=2,
                       hetero_repeats=2, warmup=2, setup_tokens_per_step=setup,
                       time_budget_s=0.8 * time_budget_s)


class _FreeingExecutor:
    """Passes steps through and remembers which requests reached the ranks and which were freed, so
    everything the profiler started can be freed at the end (``free_rest``)."""

    overlaps = False
    launches_ahead = False

    def __init__(self, executor: Executor, num_ranks: int) -> None:
        self.executor, self.num_ranks = executor, num_ranks
        self.sent: set[str] = set()
        self.freed: set[str] = set()
        self.next_step = 0

    def execute(self, step_input: StepInput) -> StepResult:
        plan = step_input.plan
        self.sent.update(r.request_id for r in step_input.new_requests)
        self.freed.update(plan.finished)
        self.next_step = plan.step + 1
        return self.executor.execute(step_input)

    def free_rest(self) -> None:
        from ..contracts.step import StepInput

        rest = sorted(self.sent - self.freed)
        if rest:
            self.execute(StepInput(StepPlan(self.next_step, decode=[[] for _ in range(self.num_ranks)],
                                            finished=rest)))


def auto_profile(config: EngineConfig, executor: Executor, hardware: str, *, time_budget_s: float = 60.0,
                 out_dir: Path | None = None, grid: ProfileGrid | None = None,
                 rank_kv_blocks_held: Callable[[], Sequence[int]] | None = None,
                 logger: logging.Logger | None = None) -> Path:
    """Profile ``config``'s instance on its built ``executor`` (idle: no request in flight) and write
    the fitted profile as ``<out_dir>/<profile_key>.json`` (default: the user cache). Every request the
    profiler started is freed again; ``rank_kv_blocks_held`` (optional) checks it on the ranks."""
    from ..loader import resolve_model

    logger = logger or log
    mc = resolve_model(config.model).config
    kv_tokens = executor.blocks_per_rank * config.block_size
    grid = grid or auto_grid(kv_tokens, config.context_limit(mc), config.device, time_budget_s)
    key = profile_key(config.model, hardware, config.num_ranks, config.tp_size, config.dtype, config.xp_mode)
    logger.info("profiling %s for the estimator (budget %.0f s; decodes %s at contexts %s, chunks %s)", key,
                time_budget_s, grid.decode_batch, grid.decode_context, grid.prefill_chunk)
    t0 = time.monotonic()
    folder = Path(out_dir) if out_dir is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fd, raw_tmp = tempfile.mkstemp(prefix=f".raw-{key}.", suffix=".tmp", dir=folder)
    os.close(fd)
    freeing = _FreeingExecutor(executor, config.num_ranks)
    try:
        try:
            profile = profile_engine(config, grid, normalize_hardware(hardware), executor=freeing, log=logger.info,
                                     raw_out=raw_tmp)
        finally:
            freeing.free_rest()
        profile = replace(profile, meta={**profile.meta, "engine_revision": ENGINE_REVISION})
        if rank_kv_blocks_held is not None and any(held := list(rank_kv_blocks_held())):
            raise RuntimeError(f"auto_profile: ranks still hold KV blocks {held} after profiling")
        # the samples beside the profile: the scheduler's online refit keeps them in every fit (scheduler/fitting/online.py)
        os.replace(raw_tmp, raw_samples_path(folder / f"{key}.json"))
    finally:
        if os.path.exists(raw_tmp):
            os.unlink(raw_tmp)
    path = _write_atomically(profile, folder, key)
    logger.info("profiled %s in %.1f s -> %s (held-out MAPE %s %%)", key, time.monotonic() - t0, path,
                _fmt(profile.meta.get("mape_percent_hetero_heldout")))
    return path


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _write_atomically(profile: EstimatorProfile, folder: Path, key: str) -> Path:
    """Write via a temporary file and rename: instances starting together never read half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        profile.to_json(tmp)
        path = folder / f"{key}.json"
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def resolve_estimator_profile(config: EngineConfig, executor: Executor, hardware: str, *,
                              time_budget_s: float = 60.0, search: Sequence[Path] | None = None,
                              out_dir: Path | None = None,
                              rank_kv_blocks_held: Callable[[], Sequence[int]] | None = None,
                              logger: logging.Logger | None = None) -> str:
    """The ``estimator_profile`` the scheduler should load: 'budget' or a file path (module docstring).
    ``hardware``: the ranks' device name (any spelling ``normalize_hardware`` takes; 'cpu' on CPU)."""
    logger = logger or log
    wanted = config.scheduler.estimator_profile
    if wanted != "auto":
        return wanted
    key = profile_key(config.model, hardware, config.num_ranks, config.tp_size, config.dtype, config.xp_mode)
    found = resolve_profile(config.model, hardware, config.num_ranks, config.tp_size, config.dtype,
                            xp_mode=config.xp_mode, search=search)
    if found is not None:
        logger.info("estimator profile 'auto': %s", found)
        return str(found)
    if not config.scheduler.uses_estimator():
        logger.info("estimator profile 'auto': none for %s; 'budget' (policy %s does not use the estimator)",
                    key, config.scheduler.policy)
        return "budget"
    if not config.on_cuda:
        logger.info("estimator profile 'auto': none for %s on CPU; using the built-in 'budget' profile "
                    "(run `conflux profile` and put the file in %s to use one)", key, cache_dir())
        return "budget"
    try:
        path = auto_profile(config, executor, hardware, time_budget_s=time_budget_s, out_dir=out_dir,
                            rank_kv_blocks_held=rank_kv_blocks_held, logger=logger)
    except RuntimeError as e:  # e.g. a pool too small for the grid (a GPU shared with another process)
        logger.warning("estimator profile 'auto': profiling %s failed (%s); using the built-in 'budget' "
                       "profile", key, e)
        return "budget"
    fitted = EstimatorProfile.from_json(path)
    if poor_fit(fitted):
        logger.warning("estimator profile 'auto': the fit for %s is poor (held-out MAPE %s %% > %.0f %%); "
                       "using the built-in 'budget' profile (the fit stays in %s for inspection)",
                       key, _fmt(fitted.meta.get("mape_percent_hetero_heldout")), MAX_PROFILE_MAPE, path)
        return "budget"
    return str(path)
