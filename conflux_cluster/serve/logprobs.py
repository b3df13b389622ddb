"""Logprobs in OpenAI's two shapes, from the engine's per-token values.

Per output token the engine gives the sampled token's logprob and, when asked, its ``k`` most
likely alternatives ``[(token id, logprob), ...]`` (log-softmax of the model's logits, before any
penalty or temperature, as vLLM's default). A token's text is its own decode (``"token"``), so a
streamed response and a whole one carry the same entries.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from .protocol import ChoiceLogprobs, CompletionLogprobs

TopLogprobs = Sequence[tuple[int, float]]  # one token's alternatives, most likely first


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(tok: _Decoder, ids: Sequence[int], lps: Sequence[float], tops: Sequence[TopLogprobs],
                  k: int) -> ChoiceLogprobs:
    """Chat form: one ``content`` entry per token, each with its ``k`` ``top_logprobs``."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        alts = tops[i][:k] if k and i < len(tops) else ()
        content.append({**_entry(tok.decode([t]), lp),
                        "top_logprobs": [_entry(tok.decode([a]), alp) for a, alp in alts]})
    return ChoiceLogprobs(content=content)


def completion_logprobs(tok: _Decoder, ids: Sequence[int], lps: Sequence[float], tops: Sequence[TopLogprobs],
                        k: int, offset: int) -> CompletionLogprobs:
    """Legacy completions form; ``offset``: characters of the choice's text before these tokens. With
    ``k`` > 0 each position's ``top_logprobs`` maps the ``k`` most likely tokens' texts (and the sampled
    one's, as vLLM does) to their logprobs."""
    toks = [tok.decode([t]) for t in ids]
    offsets, pos = [], offset
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    top = None
    if k:
        top = []
        for i, (text, lp) in enumerate(zip(toks, lps)):
            alts = {tok.decode([a]): alp for a, alp in (tops[i][:k] if i < len(tops) else ())}
            alts.setdefault(text, lp)
            top.append(alts)
    return CompletionLogprobs(tokens=toks, token_logprobs=list(lps), top_logprobs=top, text_offset=offsets)
