"""Per-token sampling seeds, shared by the sampler (engine/sampling.py) and the places that derive a
choice's seed without torch (the HTTP handlers, the ``LLM`` API for ``n > 1``)."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): well-spread 63-bit generator seeds for consecutive indices."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
