"""Content hashes of KV blocks for the prefix cache (pure Python, no torch).

A block's hash covers its own tokens AND every token before it (a chain), so equal hashes mean
equal prefixes, not just equal blocks::

    prompt:  [ t0 .. t15 ][ t16 .. t31 ][ t32 .. t40 ]      block_size = 16
    hashes:    h0 = H(0, b0)  h1 = H(h0, b1)                 (the partial last block has none)

Only full blocks get a hash: a block is shared only when all ``block_size`` tokens are equal.
The engine core computes the hashes (it has the tokens) and hands them to the scheduler with
the request; the simulator builds them from a trace's ``hash_ids`` (``chain_hashes`` over
synthetic block contents), so both run the same cache policy.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Container, Iterable, Sequence

ROOT = 0  # parent hash of a request's first block


def next_hash(parent: int, block: Sequence[int]) -> int:
    """63-bit hash of ``block`` (token ids, or any ints) chained after ``parent``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", block).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def chain_hashes(blocks: Iterable[Sequence[int]], parent: int = ROOT) -> list[int]:
    """Hashes of consecutive blocks, each chained after the one before."""
    out = []
    for block in blocks:
        parent = next_hash(parent, block)
        out.append(parent)
    return out


def leading_run(hashes: Sequence[int], present: Container[int], start: int = 0) -> int:
    """How many of ``hashes``, from the first, are in ``present`` (a cached prefix's length in blocks:
    chained hashes make the first miss end it); ``start``: the first ``start`` are known to be."""
    n = start
    while n < len(hashes) and hashes[n] in present:
        n += 1
    return n


def extend_hashes(hashes: Sequence[int], token_ids: Sequence[int], block_size: int) -> list[int]:
    """``block_hashes(token_ids)``, given the hashes of its first ``len(hashes)`` full blocks (a prompt's,
    when ``token_ids`` is the prompt followed by outputs): only the new blocks are hashed."""
    done, full = len(hashes), len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT
    return list(hashes[:full]) + chain_hashes(
        (token_ids[i * block_size:(i + 1) * block_size] for i in range(done, full)), parent)


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size``-token blocks of ``token_ids``."""
    return extend_hashes((), token_ids, block_size)


def shared_run(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chained-hash lists share (binary search: chained hashes agree at block k
    only if they agree at every block before it)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
