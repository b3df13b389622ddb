"""Served steps as estimator samples: one JSON line per executed step (``EngineConfig.step_log``), with
the shape the latency estimator sees (per-rank prefill and decode tokens, decode context, prefill
chunks with their history), the measured time (``seconds``: the gap its tokens saw, as the scheduler's
calibration measures it; ``device_s`` on CUDA: its time on the device's timeline) and the estimate the
scheduler planned with.

    conflux serve ... --step-log steps.jsonl                     # each instance: steps.<index>.jsonl
    conflux profile --fit-only steps.0.jsonl --model ... --out p.json    # refit on served steps
    python -m benchmarks.step_logs estimator steps.0.jsonl --profile p.json   # MAPE on served steps

The profiler's samples are made-up batches timed in isolation; these are the iterations the server
ran, so their MAPE is the estimator's error where it matters (issue 11: "held-out MAPE on real
iterations"). Lines go through the file's buffer, flushed every ``FLUSH_EVERY`` steps and whenever the
engine runs out of work (``EngineCore.step``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from ...util.json_file import read_text_file
from ..estimator import BatchLoad
from .fit import BatchSample

FLUSH_EVERY = 64


def instance_path(path: str, index: int) -> str:
    """Instance ``index``'s own file: ``steps.jsonl`` -> ``steps.<index>.jsonl``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{index}{p.suffix or '.jsonl'}"))


class StepLog:
    """Appends one line per step to ``path`` (created with its directory)."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = p.open("a", encoding="utf-8")
        self._since_flush = 0

    def record(self, load: BatchLoad, measured_s: float, estimated_s: float | None,
               compute_s: float | None = None, launch_s: float | None = None,
               device_s: float | None = None) -> None:
        """``compute_s``: the slowest rank's time inside the step (None: not measured); the rest of
        ``measured_s`` is host and control plane. ``launch_s``: the slowest rank's host time launching
        the step where ranks launch ahead (None: not measured). ``device_s``: the step's time on the
        slowest rank's device timeline (``StepResult.device_s``; None: not measured)."""
        if self._file is None:
            return
        line = {"seconds": measured_s, "estimated_s": estimated_s, "prefill_tokens": list(load.prefill_tokens),
                "decode_tokens": list(load.decode_tokens), "decode_context": list(load.decode_context),
                "prefill_chunks": [list(c) for c in load.prefill_chunks]}
        if compute_s is not None:
            line["compute_s"] = compute_s
        if launch_s is not None:
            line["launch_s"] = launch_s
        if device_s is not None:
            line["device_s"] = device_s
        self._file.write(json.dumps(line) + "\n")
        self._since_flush += 1
        if self._since_flush >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._since_flush = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_step_log(path: str) -> list[BatchSample]:
    """The logged steps as estimator samples (the estimate each was planned with stays in the file), each
    timed by its wall time (``seconds``, what the scheduler observes). Empty steps (no tokens) and a torn
    last line are skipped; any other malformed line is a ValueError naming its line number."""
    return [sample for sample, _ in read_logged_steps(path)]


def read_logged_steps(path: str) -> list[tuple[BatchSample, float | None]]:
    """``read_step_log``'s samples, each with the estimate the scheduler planned it with (None: none)."""
    steps: list[tuple[BatchSample, float | None]] = []
    lines = read_text_file(path).splitlines()  # ValueError naming the file for a binary one
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            d = json.loads(text)
            load = BatchLoad(tuple(int(x) for x in d["prefill_tokens"]), tuple(int(x) for x in d["decode_tokens"]),
                             tuple(int(x) for x in d["decode_context"]),
                             tuple((int(c[0]), int(c[1])) for c in d["prefill_chunks"]))
            seconds = float(d["seconds"])
            estimated = float(d["estimated_s"]) if d.get("estimated_s") is not None else None
        except (ValueError, KeyError, TypeError, IndexError) as e:
            if i == len(lines):  # the writer stopped mid-line
                break
            raise ValueError(f"{path}:{i}: not a step-log line ({e})") from None
        if seconds <= 0 or not (any(load.prefill_tokens) or any(load.decode_tokens)):
            continue
        steps.append((BatchSample(load, seconds), estimated))
    return steps


def family(load: BatchLoad) -> str:
    """The profiler's family of a step: ``decode`` (no prefill), ``prefill`` (no decode) or ``hetero``."""
    has_p, has_d = any(load.prefill_tokens), any(load.decode_tokens)
    return "hetero" if has_p and has_d else ("prefill" if has_p else "decode")
