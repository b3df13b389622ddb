"""Range checks of command-line numbers that argparse's types do not make (``conflux bench`` /
``simulate``): an error names the flag before anything runs."""

from __future__ import annotations


def require_positive(flags: dict[str, float | int | None]) -> None:
    """ValueError naming the first flag whose value is set and not > 0 (NaN included)."""
    for flag, value in flags.items():
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
