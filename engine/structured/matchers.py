"""One rank's grammar state: compiled grammars (cached by spec) and a matcher per constrained request.

    NewRequest(structured) ──▶ add(): compile in the background (cache hit: at once)
    each sampled row       ──▶ fill(): the row's allowed tokens as a bitmask [S, ceil(V/32)] int32
                               (rows without a constraint: all ones); called while the forward runs
    each token the rank learns (its own sample, or StepInput.first_tokens) ──▶ accept()
    plan.finished          ──▶ free()

A matcher has accepted exactly the request's outputs so far; ``accept`` takes the output index and
ignores a token it already has, so a rank that samples a request's first token and is then sent it
again cannot advance twice. After a stop token the matcher is terminated: a pipelined engine may still
decode the request once more (its token is dropped), and that row may take only stop tokens.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import xgrammar as xgr

log = logging.getLogger(__name__)

from .grammar import to_grammar, tokenizer_info
from .spec import StructuredOutput

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass
class _Matcher:
    """A request's matcher, built on first use (its grammar compiles in the background until then)."""

    compiled: Future  # -> xgr.CompiledGrammar
    pending: list[int] = field(default_factory=list)  # tokens accepted before the matcher exists
    matcher: xgr.GrammarMatcher | None = None
    accepted: int = 0  # output tokens accepted (pending included)
    dead: bool = False  # the grammar admits nothing here (an unsatisfiable schema): only stop tokens now

    def get(self) -> xgr.GrammarMatcher:
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
            for t in self.pending:
                self._accept(t)
            self.pending = []
        return self.matcher

    def accept(self, token: int) -> None:
        self.accepted += 1
        if self.matcher is None:
            self.pending.append(token)
        else:
            self._accept(token)

    def _accept(self, token: int) -> None:
        m = self.matcher
        if not self.dead and not m.is_terminated() and not m.accept_token(token):
            # only a grammar whose mask allowed nothing (the fill let stop tokens through) gets here:
            # the request ends at this stop token rather than the step failing
            log.warning("a grammar refused token %d (it admits no token here); the request ends", token)
            self.dead = True

    def ended(self) -> bool:
        return self.dead or self.get().is_terminated()


class RankGrammars:
    """Grammars of the requests one rank may sample. Built cheaply: the tokenizer and xgrammar's
    description of it are made by the first compile (in the compile thread, not in a step)."""

    def __init__(self, tokenizer: Callable[[], Tokenizer], vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = 512, fill_threads: int = 4, pin: bool = False) -> None:
        """``tokenizer`` loads the model's tokenizer; the stop tokens are its EOS ids and ``stop_token_ids``
        (the model config's), as ``EngineCore`` counts them."""
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers it
        self._load_tokenizer, self._stops = tokenizer, sorted(set(stop_token_ids))
        self._pin = pin  # keep the bitmask in pinned memory (CUDA: an asynchronous copy)
        self._buffer: torch.Tensor | None = None  # [rows, ceil(V/32)] int32, reused step after step
        self._compiler: xgr.GrammarCompiler | None = None  # made in the compile thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # spec key -> compiled, LRU
        self._max_cached = max_cached
        self._requests: dict[str, _Matcher] = {}
        self._batch = xgr.BatchGrammarMatcher(max(1, min(fill_threads, (os.cpu_count() or 2) // 2)))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, spec: StructuredOutput, outputs: Sequence[int] = ()) -> None:
        """Start ``request_id``'s matcher; ``outputs``: tokens it already produced (a recomputed request)."""
        m = _Matcher(self._compiled(spec))
        for t in outputs:
            m.accept(t)
        self._requests[request_id] = m

    def accept(self, request_id: str, index: int, token: int) -> None:
        """Output ``index`` of ``request_id`` is ``token`` (no-op when already accepted)."""
        m = self._requests.get(request_id)
        if m is None or index < m.accepted:
            return
        if index != m.accepted:
            raise RuntimeError(f"{request_id}: output {index} arrived before output {m.accepted}")
        m.accept(token)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def fill(self, request_ids: Sequence[str]) -> torch.Tensor | None:
        """Bitmask [S, ceil(V/32)] int32 on the CPU for rows ``request_ids``, or None if none is constrained."""
        rows = [(i, self._requests[r]) for i, r in enumerate(request_ids) if r in self._requests]
        if not rows:
            return None
        bitmask = self._rows(len(request_ids))  # all ones
        live, indices = [], []
        for i, m in rows:
            if m.ended():  # decoded once more after its stop token (that token is dropped), or dead
                self._stops_only(bitmask[i])
            else:
                live.append(m.get())
                indices.append(i)
        if len(live) == 1:
            live[0].fill_next_token_bitmask(bitmask, indices[0])
        elif live:  # rows in parallel on xgrammar's threads
            self._batch.batch_fill_next_token_bitmask(live, bitmask, indices)
        if live:
            for i in torch.tensor(indices)[~bitmask[indices].any(dim=1)].tolist():  # a grammar with no way on
                self._stops_only(bitmask[i])
        return bitmask

    def _stops_only(self, row: torch.Tensor) -> None:
        row.zero_()
        for t in self._stops:
            row[t // 32] |= _bit(t % 32)

    def _rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused buffer, all ones. Reuse is safe: the sampler reads a step's
        mask (and waits for its tokens) before the next step fills it."""
        if self._buffer is None or self._buffer.shape[0] < n:
            buf = xgr.allocate_token_bitmask(max(n, 64), self.vocab_size)
            self._buffer = buf.pin_memory() if self._pin else buf
        rows = self._buffer[:n]
        rows.fill_(-1)
        return rows

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compiled(self, spec: StructuredOutput) -> Future:
        key = spec.key()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        future = self._pool.submit(self._compile, spec)
        self._cache[key] = future
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:  # compile thread
        if self._compiler is None:
            tokenizer = self._load_tokenizer()
            self._stops = sorted(set(self._stops) | set(tokenizer.eos_token_ids))  # read after a compile only
            info = tokenizer_info(tokenizer, self.vocab_size, self._stops)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler.compile_grammar(to_grammar(spec))


def _bit(k: int) -> int:
    """Bit ``k`` of an int32 word as a Python int (bit 31 is the sign bit)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
