"""Logprobs in OpenAI's two shapes, from the engine's per-token values.

Per output token the engine gives the sampled token's logprob and, when asked, its ``k`` most
likely alternatives ``[(token id, logprob), ...]`` (log-softmax of the model's logits, before any
penalty or temperature, as vLLM's default). A token's text is its own decode (``"token"``), so a
streamed response and a whole one carry the same entries.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from conflux_cluster.engine.prompt_logprobs import PromptLogprob

from .protocol import ChoiceLogprobs, CompletionLogprobs

TopLogprobs = Sequence[tuple[int, float]]  # one token's alternatives, most likely first


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _entry(tok: _Decoder, token_id: int, logprob: float, skip_special_tokens: bool = True) -> dict:
    """OpenAI's entry: the token's text, decoded as the output text is (``skip_special_tokens``), and its own
    bytes (a token holding part of a character decodes to U+FFFD, but its ``bytes`` are the real ones, so a
    client can join them into the character)."""
    text = tok.decode([token_id], skip_special_tokens=skip_special_tokens)
    own = getattr(tok, "token_bytes", None)
    raw = own(token_id) if own is not None and "\ufffd" in text else text.encode("utf-8", "replace")
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tok: _Decoder, ids: Sequence[int], lps: Sequence[float], tops: Sequence[TopLogprobs],
                  k: int, skip_special_tokens: bool = True) -> ChoiceLogprobs:
    """Chat form: one ``content`` entry per token, each with its ``k`` ``top_logprobs``; a special token's text
    is kept where the output text keeps it (``skip_special_tokens`` false)."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        alts = tops[i][:k] if k and i < len(tops) else ()
        content.append({**_entry(tok, t, lp, skip_special_tokens),
                        "top_logprobs": [_entry(tok, a, alp, skip_special_tokens) for a, alp in alts]})
    return ChoiceLogprobs(content=content)


def completion_logprobs(tok: _Decoder, ids: Sequence[int], lps: Sequence[float], tops: Sequence[TopLogprobs],
                        k: int, offset: int, skip_special_tokens: bool = True) -> CompletionLogprobs:
    """Legacy completions form; ``offset``: characters of the choice's text before these tokens. Each
    position's ``top_logprobs`` maps the ``k`` most likely tokens' texts and the sampled one's (so up to k + 1:
    OpenAI's rule, which vLLM follows; with ``k`` = 0 the sampled one alone) to their logprobs. A token's text
    is decoded as the output text is (``skip_special_tokens``), so the tokens join into it and each offset
    indexes it."""
    def text_of(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=skip_special_tokens)

    toks = [text_of(t) for t in ids]
    offsets, pos = [], offset
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    top = []
    for i, (text, lp) in enumerate(zip(toks, lps)):
        alts = {text_of(a): alp for a, alp in (tops[i][:k] if k and i < len(tops) else ())}
        alts.setdefault(text, lp)
        top.append(alts)
    return CompletionLogprobs(tokens=toks, token_logprobs=list(lps), top_logprobs=top, text_offset=offsets)


def prompt_logprobs(tok: _Decoder, prompt_ids: Sequence[int], scores: Sequence[PromptLogprob | None] | None,
                    k: int) -> list[dict[str, dict] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position ``None`` (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}`` holding the prompt's own token and the ``k`` most likely there."""
    if scores is None:
        return None
    out: list[dict[str, dict] | None] = []
    for token, score in zip(prompt_ids, scores):
        if score is None:
            out.append(None)
            continue
        entry = {str(a): {"logprob": alp, "rank": r, "decoded_token": tok.decode([a])}
                 for r, (a, alp) in enumerate(score.top[:k], start=1)}
        entry.setdefault(str(token), {"logprob": score.logprob, "rank": score.rank, "decoded_token": tok.decode([token])})
        out.append(entry)
    return out


def echoed_completion_logprobs(tok: _Decoder, prompt_ids: Sequence[int], scores: Sequence[PromptLogprob | None],
                               k: int, output: CompletionLogprobs) -> CompletionLogprobs:
    """``echo`` with ``logprobs``: the prompt's tokens (the first without a logprob, as OpenAI) before the
    output's, whose text offsets move past the prompt's text. A prompt token's text keeps special tokens, as
    the echoed prompt does, so each offset indexes the choice's text."""
    def text_of(token_id: int) -> str:
        return tok.decode([token_id], skip_special_tokens=False)

    toks = [text_of(t) for t in prompt_ids]
    lps = [None if s is None else s.logprob for s in scores]
    tops = [None if s is None else _with_own({text_of(a): alp for a, alp in s.top[:k]}, text, s.logprob)
            for s, text in zip(scores, toks)]
    offsets, pos = [], 0
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    shift = pos
    return CompletionLogprobs(tokens=toks + output.tokens, token_logprobs=lps + output.token_logprobs,
                              top_logprobs=tops + (output.top_logprobs or []),
                              text_offset=offsets + [o + shift for o in output.text_offset])


def _with_own(alts: dict[str, float], text: str, logprob: float) -> dict[str, float]:
    """``alts`` with the position's own token in it (as vLLM adds the sampled one)."""
    alts.setdefault(text, logprob)
    return alts
