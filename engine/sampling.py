"""Turning logits into tokens: greedy, temperature, top-k, top-p; seeded per (request, output index).

All rows of a step are sampled together on the logits' device, with one host transfer at the end:

    logits [S, V] ─▶ penalties, logit_bias, min_tokens (engine/penalties.py, rows that ask) ─▶
    / temperature ─▶ min_p ─▶ top-k / top-p masks (one sort, only if a row asks) ─▶
    + Gumbel noise g[s, v] = −log(−log u[s, v]) ─▶ argmax           (Gumbel-max: an exact draw)

Reproducibility: ``u[s, v]`` is a counter-based hash of (``mix_seed(seed_s, index_s)``, v), so the
i-th output token of a request with seed ``s`` depends on that request's own logits row and
nothing else: not the other rows of the batch, not the rank or device that samples it. Greedy
rows take the plain argmax.

Logprobs are of the model's distribution (raw logits, before temperature/top-k/top-p), like vLLM.

A grammar's bitmask (``engine/structured``: bit v of row s set = token v allowed) sets every other
token's logit to -inf before the token is chosen; the logprobs stay those of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .penalties import RowProcessing, TokenHistory, min_p_filter, process_logits
from .sampling_params import SamplingParams
from .util.seeds import mix_seed
from .util.transfer import HostCopy, to_device


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1
LOGPROB_FLOOR = -9999.0  # vLLM's floor: JSON has no -inf, so a response carrying one could not be sent


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def uniform_noise(row_seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """u[s, v] in (0, 1), float32 [S, V]: SplitMix64 finalizer of row_seeds[s] + (v + 1)·φ.

    int64 arithmetic wraps (two's complement) on CPU and CUDA alike, so the bits are the same
    everywhere."""
    v = torch.arange(1, vocab + 1, dtype=torch.int64, device=row_seeds.device)
    z = row_seeds[:, None] + v[None, :] * _GOLDEN  # [S, V]
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # 24 random bits
    # the top value, 1 - 2^-25, rounds to 1.0 in float32: its Gumbel noise would be +inf, picking that
    # token whatever its logit (NaN where the logit is -inf); the largest float32 below 1 keeps it finite
    return u.clamp_(max=_BELOW_ONE)


def finite_logprobs(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf (a token the model rules out) and NaN at ``LOGPROB_FLOOR``."""
    return torch.nan_to_num(x, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)


@dataclass(frozen=True)
class SampleSpec:
    """One row to sample: the request's params, its effective seed and which output token this is."""

    params: SamplingParams
    seed: int  # params.seed, or one the engine drew at admission
    output_index: int  # 0 for the token after the prompt
    history: TokenHistory | None = None  # the tokens so far, when a penalty needs them
    blocked: tuple[int, ...] = ()  # ids min_tokens keeps out while output_index < params.min_tokens


@dataclass
class SampleOutput:
    token_ids: list[int]  # per row
    logprobs: list[float]  # per row: logprob of the chosen token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per row, [] unless asked


def _filter(logits: torch.Tensor, top_k: int | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """logits [S, V] (or [V]) float32, already divided by temperature -> same, excluded tokens at -inf.

    top_k: per row (<= 0: off); top_p: per row (1.0: off). One descending sort serves both:
    a token is kept if it ranks within top-k and within the smallest prefix whose mass reaches top_p."""
    squeeze = logits.dim() == 1
    x = logits[None] if squeeze else logits
    s, v = x.shape
    k = torch.as_tensor(top_k, device=x.device).expand(s).clone()
    k = torch.where((k <= 0) | (k > v), torch.full_like(k, v), k)  # [S]
    p = torch.as_tensor(top_p, dtype=torch.float32, device=x.device).expand(s)  # [S]
    sorted_logits, _ = torch.sort(x, dim=-1, descending=True)  # [S, V]
    probs = sorted_logits.softmax(-1)
    drop = (probs.cumsum(-1) - probs) > p[:, None]  # outside the top-p prefix
    drop |= torch.arange(v, device=x.device)[None, :] >= k[:, None]  # outside the top-k
    kept_min = sorted_logits.masked_fill(drop, float("inf")).amin(-1, keepdim=True)  # [S, 1]
    out = x.masked_fill(x < kept_min, float("-inf"))
    return out[0] if squeeze else out


def _sample_rows(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Token per row of ``logits`` [R, V] (the non-greedy rows): [R] int64 on the logits' device."""
    dev = logits.device
    temp = to_device([s.params.temperature for s in specs], dev, torch.float32)
    x = logits.float() / temp[:, None]
    if any(s.params.min_p > 0.0 for s in specs):
        x = min_p_filter(x, to_device([s.params.min_p for s in specs], dev, torch.float32))
    vocab = logits.shape[-1]
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else -1 for s in specs]  # any k >= V: all (fits int64)
    if any(k > 0 for k in top_k) or any(s.params.top_p < 1.0 for s in specs):
        x = _filter(x, to_device(top_k, dev), to_device([s.params.top_p for s in specs], dev, torch.float32))
    seeds = to_device([_i64(mix_seed(s.seed, s.output_index)) for s in specs], dev)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, logits.shape[-1])))
    return (x + gumbel).argmax(-1)


class PendingSample:
    """A step's sampled tokens on the device (``sample_async``), with their copies to the host queued behind
    them; ``result()`` waits for those copies only, not for work queued on the device after them."""

    def __init__(self, tokens: torch.Tensor, chosen: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None,
                 ks: list[int]) -> None:
        self.tokens = tokens  # [S] int64 on the logits' device: the next step may read them there
        self._ks = ks  # per row: how many top logprobs it asked for
        self._host = HostCopy((tokens, chosen, *(top or ())))
        self._out: SampleOutput | None = None

    def result(self) -> SampleOutput:
        if self._out is None:
            host = self._host.lists()  # the step's device -> host reads
            top: list[list[tuple[int, float]]] = []
            if len(host) == 4:
                top = [list(zip(ids[:k], vals[:k])) for k, vals, ids in zip(self._ks, host[2], host[3])]
            self._out = SampleOutput(host[0], host[1], top)
        return self._out


def sample(logits: torch.Tensor, specs: list[SampleSpec], bitmask: torch.Tensor | None = None) -> SampleOutput:
    """logits: [S, V] float32, one row per spec -> chosen token, its logprob, optional top-k logprobs.
    ``bitmask`` [S, ceil(V/32)] int32 on the logits' device: the tokens each row may choose (None: all)."""
    if not specs:
        return SampleOutput([], [], [])
    return sample_async(logits, specs, bitmask).result()


def sample_async(logits: torch.Tensor, specs: list[SampleSpec], bitmask: torch.Tensor | None = None) -> PendingSample:
    """``sample`` without waiting for the device: the tokens stay queued there (``PendingSample``)."""
    assert logits.shape[0] == len(specs), (logits.shape, len(specs))
    processed = process_logits(logits, [RowProcessing(s.params, s.output_index, s.history, s.blocked)
                                         for s in specs])  # ``logits`` itself unless a row asks
    if bitmask is not None:  # grammar: tokens the row's grammar refuses at -inf, after the processors
        from .structured.matchers import apply_token_bitmask  # xgrammar: only where a row has a grammar

        if processed is logits:  # the raw logits stay as they are: the logprobs are theirs
            processed = logits.clone()
        apply_token_bitmask(processed, bitmask)
    tokens = processed.argmax(-1)  # [S] greedy for every row; sampled rows overwritten below
    rows = [i for i, s in enumerate(specs) if not s.params.greedy]
    if rows:
        idx = to_device(rows, logits.device)
        tokens = tokens.index_copy(0, idx, _sample_rows(processed.index_select(0, idx), [specs[i] for i in rows]))
    logprobs_all = logits.log_softmax(-1)  # [S, V] of the model (raw logits, as vLLM's default)
    chosen = finite_logprobs(logprobs_all.gather(1, tokens[:, None])[:, 0])
    ks = [s.params.logprobs or 0 for s in specs]
    top = logprobs_all.topk(max(ks), dim=-1) if max(ks, default=0) else None
    return PendingSample(tokens, chosen, (finite_logprobs(top[0]), top[1]) if top is not None else None, ks)

