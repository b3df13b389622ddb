"""Workloads for the simulator: trace loading, generated workloads, arrivals, rate scaling, capping.

A workload is a list of ``SimRequest`` sorted by arrival (seconds from its start). Sources:

* ``load_trace(path, ...)``: any jsonl or CSV file, naming its columns (arrival, prompt length,
  output length) and the arrival unit; the Mooncake FAST'25 traces are ``load_mooncake``.
* ``toolagent_like(n, ...)``: a GENERATED stand-in for Mooncake-Toolagent (not available here):
  log-normal prompt / output lengths matching the paper's Table 3 percentiles (prompt P50 6,346 /
  P95 26,114; output P50 30 / P95 600). Its name always carries "(generated)".
* arrivals: ``poisson_arrivals`` and ``gamma_arrivals`` (bursty: coefficient of variation > 1).

``scale_to_rate`` does what the paper does (§8.1): keep a trace's arrival pattern and multiply
every inter-arrival gap by one factor so that the mean rate hits the target. ``cap_lengths``
keeps prompt + output within the model's context.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from conflux_cluster.data import MOONCAKE_BLOCK_TOKENS, TRACES_DIR  # the Mooncake traces shipped with the package


@dataclass(frozen=True)
class SimRequest:
    """One request of a workload (no text: lengths only)."""

    request_id: str
    arrival: float  # seconds from the workload's start
    prompt_len: int  # prompt tokens (≥ 1)
    output_len: int  # output tokens to generate (≥ 1; the first comes from the last prefill chunk)
    # Mooncake ``hash_ids``: one id per TRACE_BLOCK_TOKENS-token prompt block (same id = same tokens and
    # same prefix); () when the trace has none. The prefix cache and prefix-aware routing read them.
    hash_ids: tuple[int, ...] = ()


TRACE_BLOCK_TOKENS = MOONCAKE_BLOCK_TOKENS  # tokens per Mooncake hash_ids block


@dataclass(frozen=True)
class Workload:
    """A named, arrival-sorted list of requests."""

    name: str  # e.g. "conversation", "toolagent-like (generated)"
    requests: tuple[SimRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span of arrivals ((n−1)/duration)."""
        return (len(self) - 1) / self.duration if self.duration > 0 else math.inf

    def stats(self) -> dict[str, float]:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        return {"requests": len(self), "rate": self.mean_rate, "prompt_p50": float(np.percentile(p, 50)),
                "prompt_p95": float(np.percentile(p, 95)), "prompt_mean": float(p.mean()),
                "output_p50": float(np.percentile(o, 50)), "output_p95": float(np.percentile(o, 95)),
                "output_mean": float(o.mean())}


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {n} is not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: line {n} is not a JSON object")
                rows.append(row)
        return rows
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    raise ValueError(f"{path}: unsupported trace format {path.suffix!r} (use .jsonl or .csv)")


def arrival_seconds(value: object, time_unit: float = 1e-3) -> float:
    """One arrival cell in seconds: a number (or numeric text) times ``time_unit`` (epoch or relative
    seconds: 1, milliseconds: 1e-3), or an ISO-8601 timestamp (``2023-11-16 18:15:46.68``,
    ``2023-11-16T18:15:46Z``; naive ones read as UTC), which ``time_unit`` does not scale."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(float(value) * time_unit, value)
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None:
        return _finite(number * time_unit, value)
    try:
        stamp = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        raise ValueError(f"arrival {text!r} is neither a number nor an ISO-8601 timestamp") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


def _finite(seconds: float, value: object) -> float:
    if not math.isfinite(seconds):
        raise ValueError(f"arrival {value!r} is not finite")
    return seconds


def load_trace(path: str | Path, arrival_col: str = "timestamp", prompt_col: str = "input_length",
               output_col: str = "output_length", time_unit: float = 1e-3, name: str | None = None,
               limit: int | None = None) -> Workload:
    """Load any jsonl/CSV trace by naming its columns. Arrivals: numbers in ``time_unit`` seconds (ms:
    1e-3) or ISO-8601 timestamps (``arrival_seconds``); they are re-based to the first arrival."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    rows = _rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    missing = [c for c in (arrival_col, prompt_col, output_col) if c not in rows[0]]
    if missing:
        raise ValueError(f"{path}: columns {missing} not found; available: {sorted(rows[0])}")
    reqs = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        ids = row.get("hash_ids")
        try:
            reqs.append(SimRequest(f"{path.stem}-{i}", arrival_seconds(row[arrival_col], time_unit),
                                   max(1, int(float(row[prompt_col]))), max(1, int(float(row[output_col]))),
                                   tuple(int(x) for x in ids) if isinstance(ids, list) else ()))
        except KeyError as e:
            raise ValueError(f"{path}: row {i + 1}: no column {e}") from None
        except (TypeError, ValueError, OverflowError) as e:  # OverflowError: an infinite length
            raise ValueError(f"{path}: row {i + 1}: {e}") from None
    reqs.sort(key=lambda r: r.arrival)
    t0 = reqs[0].arrival
    return Workload(name or path.stem, tuple(replace(r, arrival=r.arrival - t0) for r in reqs))


def load_mooncake(kind: str, traces_dir: str | Path = TRACES_DIR, spread: bool = True) -> Workload:
    """``kind``: "conversation" or "synthetic" (Mooncake FAST'25 jsonl: ms timestamps).

    The conversation trace's timestamps are quantised to ≈3 s steps (up to 28 requests share
    one); ``spread`` places the requests of a shared timestamp evenly over the step to the next
    one (order kept), since scaling inter-arrival gaps cannot separate simultaneous arrivals.
    """
    if kind not in ("conversation", "synthetic"):
        raise ValueError(f"unknown Mooncake trace {kind!r}; available here: conversation, synthetic")
    w = load_trace(Path(traces_dir) / f"mooncake_{kind}_trace.jsonl", name=kind)
    return spread_ties(w) if spread else w


def spread_ties(workload: Workload) -> Workload:
    """Requests sharing an arrival time are spread evenly up to the next distinct arrival time."""
    times = sorted({r.arrival for r in workload.requests})
    if len(times) < 2:
        return workload
    nxt = dict(zip(times, times[1:]))
    last_gap = float(np.median(np.diff(times)))
    groups: dict[float, list[SimRequest]] = {}
    for r in workload.requests:
        groups.setdefault(r.arrival, []).append(r)
    out = []
    for t, reqs in groups.items():
        gap = nxt.get(t, t + last_gap) - t
        out.extend(replace(r, arrival=t + gap * j / len(reqs)) for j, r in enumerate(reqs))
    return Workload(workload.name, tuple(out))


# ---- arrivals -----------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times (s) of a Poisson process of ``rate`` req/s, starting at 0."""
    return gamma_arrivals(n, rate, 1.0, rng)


def gamma_arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Bursty arrivals: gamma inter-arrival gaps with mean 1/rate and coefficient of variation ``cv``."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate and cv must be > 0 (got rate={rate}, cv={cv})")
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def lognormal_from_percentiles(p50: float, p95: float) -> tuple[float, float]:
    """(μ, σ) of the log-normal whose median is p50 and 95th percentile is p95."""
    return math.log(p50), math.log(p95 / p50) / 1.6448536269514722


def toolagent_like(n: int, rate: float = 1.0, seed: int = 0, cv: float = 1.0) -> Workload:
    """GENERATED stand-in for Mooncake-Toolagent (paper Table 3 percentiles; arrivals gamma with ``cv``)."""
    rng = np.random.default_rng(seed)
    mu_p, sd_p = lognormal_from_percentiles(6346, 26114)
    mu_o, sd_o = lognormal_from_percentiles(30, 600)
    prompts = np.maximum(1, np.rint(rng.lognormal(mu_p, sd_p, n))).astype(int)
    outputs = np.maximum(1, np.rint(rng.lognormal(mu_o, sd_o, n))).astype(int)
    t = gamma_arrivals(n, rate, cv, rng)
    reqs = tuple(SimRequest(f"toolagent-gen-{i}", float(t[i]), int(prompts[i]), int(outputs[i])) for i in range(n))
    return Workload("toolagent-like (generated)", reqs)


def with_arrivals(workload: Workload, arrivals: np.ndarray, name: str | None = None) -> Workload:
    """Replace arrival times (e.g. Poisson) keeping lengths."""
    reqs = tuple(replace(r, arrival=float(t)) for r, t in zip(workload.requests, arrivals))
    return Workload(name or workload.name, reqs)


# ---- shaping ------------------------------------------------------------------------------
def take(workload: Workload, n: int, offset: int = 0) -> Workload:
    """A contiguous slice of ``n`` requests (arrivals re-based to 0)."""
    reqs = workload.requests[offset:offset + n]
    if not reqs:
        raise ValueError(f"empty slice: offset={offset} n={n} of {len(workload)} requests")
    t0 = reqs[0].arrival
    return Workload(workload.name, tuple(replace(r, arrival=r.arrival - t0) for r in reqs))


def session_indices(hash_ids: list[tuple[int, ...]], n: int, seed: int = 0, key_blocks: int = 2) -> list[int]:
    """Indices (ascending) of ``n`` requests of whole sessions drawn at random.

    A contiguous slice of a long trace keeps little of its prefix reuse: a conversation's turns lie
    minutes apart, so the first 200 Mooncake-conversation requests repeat 5.8 % of their prompt blocks
    against 36.6 % over the whole trace. Here requests whose first ``key_blocks`` ``hash_ids`` agree
    count as one session (in the conversation trace: the shared system block, then the conversation's
    own first block); sessions are taken in a seeded random order until ``n`` requests are held, and
    the latest requests past ``n`` are dropped. A request without ``hash_ids`` is a session of its own.
    """
    if n < 1 or key_blocks < 1:
        raise ValueError(f"sampling sessions needs n >= 1 and key_blocks >= 1, got n={n}, key_blocks={key_blocks}")
    sessions: dict[object, list[int]] = {}
    for i, ids in enumerate(hash_ids):
        key = tuple(ids[:key_blocks]) if ids else ("request", i)
        sessions.setdefault(key, []).append(i)
    order = list(sessions.values())
    np.random.default_rng(seed).shuffle(order)
    picked: list[int] = []
    for members in order:
        if len(picked) >= n:
            break
        picked.extend(members)
    return sorted(picked)[:n]


def sample_sessions(workload: Workload, n: int, seed: int = 0, key_blocks: int = 2) -> Workload:
    """``session_indices`` of the workload's requests, in trace order (arrivals re-based to 0)."""
    keep = session_indices([r.hash_ids for r in workload.requests], n, seed, key_blocks)
    reqs = [workload.requests[i] for i in keep]
    t0 = reqs[0].arrival
    return Workload(f"{workload.name} (sessions)", tuple(replace(r, arrival=r.arrival - t0) for r in reqs))


def scale_to_rate(workload: Workload, rate: float) -> Workload:
    """Uniformly scale inter-arrival gaps so the mean rate becomes ``rate`` req/s (paper §8.1)."""
    if not 0 < rate < math.inf:  # NaN too
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    if len(workload) < 2 or workload.duration <= 0:
        return workload
    k = workload.mean_rate / rate
    t0 = workload.requests[0].arrival
    reqs = tuple(replace(r, arrival=(r.arrival - t0) * k) for r in workload.requests)
    return Workload(workload.name, reqs)


def cap_lengths(workload: Workload, max_context: int) -> Workload:
    """Cap output at half the context and the prompt at what is left, so prompt + output ≤ context."""
    reqs = []
    for r in workload.requests:
        out = min(r.output_len, max_context // 2)
        reqs.append(replace(r, output_len=out, prompt_len=min(r.prompt_len, max_context - out)))
    return Workload(workload.name, tuple(reqs))


def make_workload(kind: str, n: int, seed: int = 0, offset: int = 0, path: str | None = None,
                  columns: tuple[str, str, str] | None = None, time_unit: float = 1e-3) -> Workload:
    """By name: "conversation" | "synthetic" (Mooncake, a contiguous slice) | "conversation-sessions"
    (whole conversations sampled with ``seed``: ``sample_sessions``) | "toolagent" (generated) | "file"
    (``path``)."""
    if kind in ("conversation", "synthetic"):
        return take(load_mooncake(kind), n, offset)
    if kind == "conversation-sessions":
        if offset:
            raise ValueError("workload 'conversation-sessions' samples the whole trace: it takes no offset")
        return sample_sessions(load_mooncake("conversation"), n, seed=seed)
    if kind in ("toolagent", "toolagent-like"):
        return toolagent_like(n, seed=seed)
    if kind == "file":
        if not path:
            raise ValueError("workload 'file' needs a path")
        cols = columns or ("timestamp", "input_length", "output_length")
        return take(load_trace(path, *cols, time_unit=time_unit), n, offset)
    raise ValueError(f"unknown workload {kind!r}; choose conversation, conversation-sessions, synthetic, toolagent, file")
