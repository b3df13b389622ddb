"""One rank's grammar state: compiled grammars (cached by spec) and a matcher per constrained request.

    NewRequest(structured) ──▶ add(): compile in the background (cache hit: at once)
    each token the rank learns (its own sample, or StepInput.first_tokens) ──▶ accept(): noted only
    each sampled row       ──▶ fill(): the noted tokens go to the matchers (one batched call), then
                               the row's allowed tokens as a bitmask [S, ceil(V/32)] int32 (rows
                               without a constraint: all ones); called while the forward runs
    plan.finished          ──▶ free()

Nothing grammar-related runs between a step's token sync and the next forward's launch: ``accept`` only
appends, and xgrammar sees the tokens at the next ``fill``, which the worker calls once the next forward
is queued (the host work overlaps the device's). The mask is built with numpy, not torch CPU ops, whose
intra-op threads would contend with xgrammar's fill threads for the host's cores.

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

import numpy as np
import torch
import xgrammar as xgr

from .grammar import to_grammar, tokenizer_info
from .spec import StructuredOutput

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Matcher:
    """A request's matcher, built on first use (its grammar compiles in the background until then)."""

    compiled: Future  # -> xgr.CompiledGrammar
    pending: list[int] = field(default_factory=list)  # accepted tokens xgrammar has not seen yet
    matcher: xgr.GrammarMatcher | None = None
    accepted: int = 0  # output tokens accepted (pending included)
    dead: bool = False  # the grammar admits nothing here (an unsatisfiable schema): only stop tokens now

    def get(self) -> xgr.GrammarMatcher | None:
        """The matcher (None: dead before it was built). A grammar that compiled at the ingress but fails
        here ends its request at a stop token, logged, rather than failing the step of every request."""
        if self.matcher is None and not self.dead:
            try:
                self.matcher = xgr.GrammarMatcher(self.compiled.result())
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError from C++, and more
                log.error("a grammar failed to build on the rank (%r); its request ends", e)
                self.dead = True
        return self.matcher

    def accept(self, token: int) -> None:
        self.accepted += 1
        self.pending.append(token)

    def ended(self) -> bool:
        """Terminated (it took a stop token) or dead; call after ``_advance``."""
        matcher = self.get()
        return self.dead or matcher.is_terminated()


def _advance(matchers: Sequence[_Matcher]) -> None:
    """Hand xgrammar the tokens each matcher accepted since the last fill: one batched call per token
    depth (usually one). A terminated or dead matcher drops its tokens."""
    while True:
        todo = [m for m in matchers if m.pending]
        if not todo:
            return
        live, tokens = [], []
        for m in todo:
            token = m.pending.pop(0)
            if not m.ended():
                live.append(m)
                tokens.append(token)
        if not live:
            continue
        for m, ok in zip(live, xgr.BatchGrammarMatcher.batch_accept_token([m.matcher for m in live], tokens)):
            if not ok:
                # only a grammar whose mask allowed nothing (the fill let stop tokens through) gets here:
                # the request ends at this stop token rather than the step failing
                log.warning("a grammar refused a token (it admits no token here); the request ends")
                m.dead = True


class RankGrammars:
    """Grammars of the requests one rank may sample. Built cheaply: the tokenizer and xgrammar's
    description of it are made by the first compile (in the compile thread, not in a step).

    Bitmask widths: the sampler's mask covers the logits (``vocab_size`` tokens, W words); xgrammar's
    covers its tokenizer description (``grammar_vocab`` tokens, w words), which for the byte tokenizer
    is its 258 ids only: its padding ids are not described to xgrammar (which would count each as a
    special token and scan them all at every accepted token). Where w < W a row is filled into a
    narrow buffer and copied, with the words past w zero (never allowed). xgrammar's last word may set
    bits past its vocabulary (ids 258..287 of word 8 for the byte tokenizer), so in every constrained
    row that word, the one holding id ``grammar_vocab``, keeps only the bits of ids below it::

        ids:    0 ........ 255 256 257 | 258 ... 287 | 288 ... V-1
        row s:  [ xgrammar's w words   |   cleared   | 0 ... 0 ]   (W words; unconstrained rows: all ones)
    """

    def __init__(self, tokenizer: Callable[[], Tokenizer], vocab_size: int, stop_token_ids: Sequence[int],
                 max_cached: int = 512, fill_threads: int = 4, pin: bool = False) -> None:
        """``tokenizer`` loads the model's tokenizer; the stop tokens are its EOS ids and ``stop_token_ids``
        (the model config's), as ``EngineCore`` counts them."""
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers it
        self.grammar_vocab = vocab_size  # the tokens xgrammar knows (set by the first compile)
        self._load_tokenizer, self._stops = tokenizer, sorted(set(stop_token_ids))
        self._pin = pin  # keep the bitmask in pinned memory (CUDA: an asynchronous copy)
        self._buffer: torch.Tensor | None = None  # [rows, W] int32, reused step after step
        self._narrow: torch.Tensor | None = None  # [rows, w] int32 where w < W: xgrammar's rows
        self._stop_row: np.ndarray | None = None  # [W] int32: the stop tokens only
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
        """Output ``index`` of ``request_id`` is ``token`` (no-op when already accepted). Only noted: the
        matcher advances at the next ``fill``."""
        m = self._requests.get(request_id)
        if m is None or index < m.accepted:
            return
        if index != m.accepted:
            raise RuntimeError(f"{request_id}: output {index} arrived before output {m.accepted}")
        m.accept(token)

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def fill(self, request_ids: Sequence[str]) -> torch.Tensor | None:
        """Bitmask [S, W] int32 on the CPU for rows ``request_ids``, or None if none is constrained."""
        rows = [(i, self._requests[r]) for i, r in enumerate(request_ids) if r in self._requests]
        if not rows:
            return None
        _advance([m for _, m in rows])
        ended = [m.ended() for _, m in rows]  # (builds each matcher: its grammar compiled, the widths known)
        bitmask = self._rows(len(request_ids))
        words = bitmask.numpy()  # [S, W] view
        words.fill(-1)
        live = []
        for (i, m), done in zip(rows, ended):
            if done:  # decoded once more after its stop token, or dead
                words[i] = self._stops_only()
            else:
                live.append((i, m))
        if not live:
            return bitmask
        indices = [i for i, _ in live]
        narrow = self._narrow[: len(request_ids)] if self._narrow is not None else bitmask
        if len(live) == 1:
            live[0][1].matcher.fill_next_token_bitmask(narrow, indices[0])
        else:  # rows in parallel on xgrammar's threads
            self._batch.batch_fill_next_token_bitmask([m.matcher for _, m in live], narrow, indices)
        if narrow is not bitmask:
            filled = narrow.numpy()[indices]  # [L, w]
            words[indices, : filled.shape[1]] = filled
            words[indices, filled.shape[1]:] = 0
        edge, known = divmod(self.grammar_vocab, 32)  # the word holding id grammar_vocab; its bits below it
        if known and edge < words.shape[1]:  # xgrammar's last word may allow ids past its vocabulary
            words[indices, edge] &= np.int32((1 << known) - 1)
        for k in np.flatnonzero(~words[indices].any(axis=1)):  # a grammar with no way on: a stop ends it
            words[indices[k]] = self._stops_only()
        return bitmask

    def _stops_only(self) -> np.ndarray:
        """[W] int32: bits of the stop tokens (fixed once a compile has read the tokenizer's EOS ids)."""
        if self._stop_row is None:
            row = np.zeros(self._buffer.shape[1], dtype=np.uint32)
            for t in self._stops:
                row[t // 32] |= np.uint32(1 << (t % 32))
            self._stop_row = row.view(np.int32)
        return self._stop_row

    def _rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the reused buffer (and of the narrow one, where xgrammar's vocabulary is
        smaller). Reuse is safe: the sampler reads a step's mask (and waits for its tokens) before the next
        step fills it."""
        if self._buffer is None or self._buffer.shape[0] < n:
            rows = max(n, 64)
            buf = xgr.allocate_token_bitmask(rows, self.vocab_size)
            self._buffer = buf.pin_memory() if self._pin else buf
            narrow = xgr.get_bitmask_shape(rows, self.grammar_vocab)
            self._narrow = xgr.allocate_token_bitmask(rows, self.grammar_vocab) \
                if narrow[1] < self._buffer.shape[1] else None
        return self._buffer[:n]

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
            self.grammar_vocab = info.vocab_size
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler.compile_grammar(to_grammar(spec))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits`` [S, V] float32 at -inf where bit v % 32 of word v // 32 of ``bitmask``
    [S, W] int32 (same device) is clear; ids past its W words (W < ceil(V/32)) are refused too.
    xgrammar's kernel: Triton on CUDA, C++ on the CPU (one pass over the logits; no [S, V] temporaries)."""
    covered = 32 * bitmask.shape[1]
    if covered < logits.shape[1]:
        logits[:, covered:] = float("-inf")  # xgrammar's kernel leaves the ids past the mask as they are
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(covered, logits.shape[1]))
