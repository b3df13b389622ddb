"""Benchmark workloads: Mooncake-format trace replay (rate-scaled) or synthetic Poisson arrivals.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, ...}``
(shipped in conflux_cluster/data/traces). Replay keeps the trace's arrival *pattern* and scales its rate::

    arrival_i = (timestamp_i − timestamp_0) / 1000 / rate_scale            (--rate-scale)
    arrival_i scaled so that n / arrival_last = request_rate              (--request-rate)

Lengths are optionally scaled (``length_scale``; the traces are 6k-40k-token prompts, far beyond a
CPU run) and capped so that ``input + output <= max_model_len``. Prompts are synthetic token ids of
exactly the trace's (scaled) input length; outputs are forced to the trace's length (``ignore_eos``).
A line's ``hash_ids`` (one per 512-token block) become real shared prefixes: the same id gives the
same block of tokens (``trace_prompt_ids``; the block shrinks with ``length_scale``), so the
trace's prefix reuse reaches the server's prefix cache and the router.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from conflux_cluster.data import MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class BenchRequest:
    """One request to send."""

    arrival_s: float  # seconds after the benchmark starts
    input_len: int  # prompt tokens
    output_len: int  # output tokens (ignore_eos: exactly this many)
    hash_ids: tuple[int, ...] = ()  # trace prompt blocks (same id = same tokens); () for synthetic prompts
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash id (scaled with the lengths)


@dataclass(frozen=True)
class LengthPolicy:
    """How trace lengths become request lengths."""

    length_scale: float = 1.0  # multiply trace input and output lengths
    max_input_len: int | None = None  # cap on prompt tokens
    max_output_len: int | None = None  # cap on output tokens
    max_model_len: int | None = None  # input + output must fit this context
    min_len: int = 1

    def apply(self, input_len: int, output_len: int) -> tuple[int, int]:
        i = max(self.min_len, round(input_len * self.length_scale))
        o = max(self.min_len, round(output_len * self.length_scale))
        if self.max_input_len is not None:
            i = min(i, self.max_input_len)
        if self.max_output_len is not None:
            o = min(o, self.max_output_len)
        if self.max_model_len is not None and i + o > self.max_model_len:
            o = max(1, min(o, self.max_model_len // 4))
            i = self.max_model_len - o
        return i, o


def load_trace(path: str | Path, num_requests: int | None = None, rate_scale: float = 1.0,
               request_rate: float | None = None, lengths: LengthPolicy = LengthPolicy(),
               start: int = 0, sessions_seed: int | None = None) -> list[BenchRequest]:
    """Read ``num_requests`` lines from ``start`` and turn them into rate-scaled requests. With
    ``sessions_seed``, the requests are whole sessions sampled over the rest of the trace instead
    (``conflux_cluster.sim.workloads.session_indices``: keeps the trace's prefix reuse)."""
    rows = []
    with open(path) as f:
        for k, line in enumerate(f):
            if k < start or not line.strip():
                continue
            try:
                d = json.loads(line)
                t = float(d["timestamp"])
                if not math.isfinite(t):
                    raise ValueError(f"timestamp {d['timestamp']!r} is not finite")
                # lengths under 1 count as 1, as the simulator reads them (a prompt needs a token)
                rows.append((t, max(1, int(d["input_length"])), max(1, int(d["output_length"])),
                             tuple(int(x) for x in d.get("hash_ids") or ())))
            except KeyError as e:
                raise ValueError(f"{path}:{k + 1}: trace line lacks {e} (Mooncake format expected)") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{k + 1}: not JSON ({e.msg})") from None
            except (TypeError, ValueError, OverflowError, AttributeError) as e:
                raise ValueError(f"{path}:{k + 1}: {e}") from None
            if num_requests is not None and len(rows) >= num_requests and sessions_seed is None:
                break
    if not rows:
        raise ValueError(f"{path}: no requests read")
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    rows.sort(key=lambda r: r[0])  # arrival order (stable: a trace's own order among equal stamps)
    if sessions_seed is not None:
        from conflux_cluster.sim.workloads import session_indices

        rows = [rows[i] for i in session_indices([r[3] for r in rows], num_requests or len(rows), sessions_seed)]
    t0 = rows[0][0]
    arrivals = [(t - t0) / 1000.0 / rate_scale for t, *_ in rows]
    if request_rate is not None:
        arrivals = _rescale_to_rate(arrivals, request_rate)
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * lengths.length_scale))
    return [BenchRequest(a, *lengths.apply(i, o), ids, block) for a, (_, i, o, ids) in zip(arrivals, rows)]


def _rescale_to_rate(arrivals: list[float], rate: float) -> list[float]:
    if rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {rate}")
    span = arrivals[-1] - arrivals[0]
    if span <= 0 or rate == float("inf"):
        return [0.0] * len(arrivals)
    factor = (len(arrivals) / rate) / span  # new span = n / rate
    return [(a - arrivals[0]) * factor for a in arrivals]


def arrival_gap(rng: random.Random, request_rate: float, burstiness: float = 1.0) -> float:
    """One inter-arrival gap, as ``vllm bench serve``: gamma with shape ``burstiness`` and mean
    1/request_rate (burstiness 1: Poisson; < 1 burstier, > 1 more uniform); 0 at an infinite rate."""
    if request_rate == float("inf"):
        return 0.0
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    if burstiness == 1.0:
        return rng.expovariate(request_rate)
    return rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))


def synthetic(num_requests: int, input_len: int, output_len: int, request_rate: float = float("inf"),
              range_ratio: float = 0.0, seed: int = 0, burstiness: float = 1.0) -> list[BenchRequest]:
    """``vllm bench serve --dataset-name random``-like: lengths uniform in ±range_ratio, gamma
    (Poisson by default) arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        i = max(1, round(input_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        o = max(1, round(output_len * rng.uniform(1 - range_ratio, 1 + range_ratio)))
        out.append(BenchRequest(t, i, o))
        t += arrival_gap(rng, request_rate, burstiness)
    return out


def request_prompts(requests: list[BenchRequest], vocab_size: int, rng: random.Random,
                    salt: int = 0) -> list[list[int]]:
    """One prompt per request: built from the trace's blocks where it has ``hash_ids``
    (``trace_prompt_ids``: shared prefixes stay shared), else random ids of its length. Runs against
    one server with different ``salt`` share no block (a prefix cache warmed by one does not serve
    the other); requests without ``hash_ids`` then draw their ids from ``rng`` and ``salt`` together, so a
    repeat of the same arrivals and lengths under another salt sends other prompts."""
    fresh = rng if salt == 0 else random.Random(f"{salt}:{rng.getrandbits(64)}")
    return [trace_prompt_ids(r, vocab_size, rng, salt=salt) if r.hash_ids
            else prompt_ids(r.input_len, vocab_size, fresh) for r in requests]


def trace_prompt_ids(req: BenchRequest, vocab_size: int, rng: random.Random, low: int = 100,
                     salt: int = 0) -> list[int]:
    """The request's prompt: one block of ``req.block_tokens`` ids per hash id, each drawn from a
    generator seeded by the id and ``salt`` (equal ids, equal blocks), cut or padded (``rng``) to
    ``input_len``."""
    out: list[int] = []
    for h in req.hash_ids:
        if len(out) >= req.input_len:
            break
        out += prompt_ids(req.block_tokens, vocab_size, random.Random(h if salt == 0 else f"{salt}:{h}"), low)
    out = out[:req.input_len]
    return out + prompt_ids(req.input_len - len(out), vocab_size, rng, low)


def prompt_ids(length: int, vocab_size: int, rng: random.Random, low: int = 100) -> list[int]:
    """Random token ids in ``[low, min(vocab, 30000))``: ordinary tokens, no specials."""
    high = max(low + 1, min(vocab_size, 30000))
    return [rng.randrange(low, high) for _ in range(length)]
