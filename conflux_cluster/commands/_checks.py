"""Checks of command-line values that argparse's types do not make (``conflux bench`` / ``profile`` /
``simulate``): an error names the flag before anything runs, so that a long run never ends in a
traceback over a typo (a NaN rate, an output folder that does not exist)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Collection
from pathlib import Path


def require_positive(flags: dict[str, float | int | None], infinite_ok: Collection[str] = ()) -> None:
    """ValueError naming the first flag whose value is set and not a finite number > 0 (NaN and inf
    included; the flags in ``infinite_ok`` may be inf, e.g. ``--request-rate inf``: all at once)."""
    for flag, value in flags.items():
        if value is None:
            continue
        if not value > 0 or (math.isinf(value) and flag not in infinite_ok):
            raise ValueError(f"{flag} must be a finite number > 0, got {value}")


def positive_floats(text: str) -> list[float]:
    """argparse type of a comma list of finite numbers > 0 (``--rates 2,4,8``); the parser's error names
    the flag."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not (v > 0 and math.isfinite(v))]
    if bad:
        raise argparse.ArgumentTypeError(f"every value must be a finite number > 0, got {bad[0]} in {text!r}")
    return values


def int_list(minimum: int):
    """argparse type of a comma list of integers >= ``minimum`` (``--prefill-chunks 32,256``); the
    parser's error names the flag."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        bad = [v for v in values if v < minimum]
        if bad:
            raise argparse.ArgumentTypeError(f"every value must be >= {minimum}, got {bad[0]} in {text!r}")
        return values
    return parse


def require_writable_file(flag: str, path: str | os.PathLike | None) -> None:
    """ValueError naming ``flag`` unless a file can be written at ``path`` (None: not asked for): not a
    folder, in a folder that exists and is writable, and writable itself if it exists."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, expected a file path")
    folder = p.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


def require_writable_folder(flag: str, path: str | os.PathLike) -> None:
    """ValueError naming ``flag`` unless ``path`` is a writable folder or one that can be made (its nearest
    existing ancestor is a writable folder)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a folder")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {existing} is not writable")
